//! Fault injection: make the Nth call (or every call from the Nth on) of a named function fail
//! with a chosen code, so reliability tests can reach every error path of the code above.
//!
//! Spec (`TMS_SIM_FAIL` or `tms_sim_set_faults`): comma-separated rules `NAME:N[+][:CODE]`, e.g.
//! `cuMemCreate:3:2` (the third cuMemCreate returns 2) or `aclrtMapMem:1+` (every aclrtMapMem
//! fails with the API's out-of-memory code). Calls are counted per process from the moment the
//! rules are set.
//!
//! `NAME:N[+]:corrupt` names a copy function instead (`cuMemcpyHtoDAsync_v2`, `cudaMemcpy`,
//! `aclrtMemcpyAsync`, ...): that call succeeds, and once its bytes have landed one byte of its
//! destination is flipped, as a bad restore would leave it (torch_memory_saver issue 71 reports
//! weights corrupted after a pause/resume with backup). Such a rule never fails the call.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub nth: u64,
    pub and_after: bool,
    pub code: Option<i32>,
    /// Corrupts what the call copies instead of failing it.
    pub corrupt: bool,
    calls: u64,
}

static ACTIVE: AtomicBool = AtomicBool::new(false);
static RULES: Mutex<Vec<Rule>> = Mutex::new(Vec::new());

pub fn parse(spec: &str) -> Result<Vec<Rule>, String> {
    let mut rules = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let fields: Vec<&str> = part.split(':').collect();
        if !(2..=3).contains(&fields.len()) || fields[0].is_empty() {
            return Err(format!("fault rule {part:?} is not NAME:N[+][:CODE]"));
        }
        let (count, and_after) = match fields[1].strip_suffix('+') {
            Some(n) => (n, true),
            None => (fields[1], false),
        };
        let nth: u64 = count
            .parse()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("fault rule {part:?}: call number must be 1 or more"))?;
        let corrupt = fields.get(2) == Some(&"corrupt");
        let code = match fields.get(2) {
            Some(c) if !corrupt => Some(
                c.parse::<i32>().map_err(|_| format!("fault rule {part:?}: bad code {c:?} (a number or corrupt)"))?,
            ),
            _ => None,
        };
        rules.push(Rule { name: fields[0].to_string(), nth, and_after, code, corrupt, calls: 0 });
    }
    Ok(rules)
}

pub fn install(rules: Vec<Rule>) {
    let mut guard = RULES.lock().unwrap_or_else(|e| e.into_inner());
    ACTIVE.store(!rules.is_empty(), Ordering::Release);
    *guard = rules;
}

/// Counts a call of `name`; returns the code to fail it with, if a rule says so.
/// `default_code` is the API's out-of-memory code, used when the rule names none.
pub fn check(name: &str, default_code: i32) -> Option<i32> {
    if !ACTIVE.load(Ordering::Acquire) {
        return None;
    }
    hit(name, false).map(|rule| rule.code.unwrap_or(default_code))
}

/// Counts a copy made by `name`; whether a `corrupt` rule says to corrupt its bytes.
pub fn corrupts(name: &str) -> bool {
    ACTIVE.load(Ordering::Acquire) && hit(name, true).is_some()
}

/// Counts a call against the first rule of its kind for `name`; the rule if this call is hit.
fn hit(name: &str, corrupt: bool) -> Option<Rule> {
    let mut guard = RULES.lock().unwrap_or_else(|e| e.into_inner());
    let rule = guard.iter_mut().find(|r| r.name == name && r.corrupt == corrupt)?;
    rule.calls += 1;
    let hit = rule.calls == rule.nth || (rule.and_after && rule.calls > rule.nth);
    hit.then(|| rule.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rules_and_rejects_garbage() {
        let r = parse("cuMemCreate:3:2, aclrtMapMem:1+").unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].nth, r[0].and_after, r[0].code), (3, false, Some(2)));
        assert_eq!((r[1].nth, r[1].and_after, r[1].code), (1, true, None));
        assert!(parse("cuMemCreate").is_err());
        assert!(parse("cuMemCreate:0").is_err());
        assert!(parse("cuMemCreate:x").is_err());
        assert!(parse("cuMemCreate:1:oops").is_err());
        let c = parse("cuMemcpyHtoDAsync_v2:2+:corrupt").unwrap();
        assert_eq!((c[0].nth, c[0].and_after, c[0].code, c[0].corrupt), (2, true, None, true));
        assert!(parse("").unwrap().is_empty());
    }
}
