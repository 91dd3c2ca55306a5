//! Which Python runs the Ray bridge (docs/ray.md, "Which Ray"). The user's own Ray comes first:
//! joining a cluster needs the cluster's Ray version, which the user's environment has and the
//! pinned one (scripts/ray-env.sh) may not. In order: run.ray_python, $TMS_RAY_VENV (both explicit:
//! no fallback when they fail), the active virtual environment, the first `python3` or `python` on
//! PATH, the pinned environment. Each candidate is asked once, with a time limit, to import Ray.

use super::super::config::Config;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Importing Ray takes about half a second on an idle machine; a loaded one can take many times
/// that, and a Python that hangs must not hang the run.
const PROBE_LIMIT: Duration = Duration::from_secs(30);

/// What a candidate prints: its Ray's version, then its own.
const PROBE: &str = "import sys, ray; print(ray.__version__); print('%d.%d.%d' % tuple(sys.version_info[:3]))";

const FIX: &str = "install Ray into the Python you use (pip install ray, the cluster's version when joining one), \
                   point run.ray_python at a Python that has it, or create the pinned environment with \
                   scripts/ray-env.sh";

/// The chosen Python, why, and what it has.
#[derive(Debug, Clone)]
pub(in crate::run) struct RayPython {
    pub path: PathBuf,
    pub why: String,
    pub ray: String,
    pub python: String,
}

impl RayPython {
    pub(in crate::run) fn describe(&self) -> String {
        format!("Ray {} (Python {}) from {}: {}", self.ray, self.python, self.path.display(), self.why)
    }
}

/// Where to look: the configuration's and the environment's values.
#[derive(Default)]
struct Places {
    explicit: String,
    ray_venv: Option<OsString>,
    virtual_env: Option<OsString>,
    path: Option<OsString>,
    /// ${XDG_CACHE_HOME:-~/.cache}, where scripts/ray-env.sh puts the pinned environment.
    cache: PathBuf,
}

impl Places {
    fn from_env(cfg: &Config) -> Places {
        let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let cache = nonempty("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| nonempty("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"));
        Places {
            explicit: cfg.run.ray_python.trim().to_string(),
            ray_venv: nonempty("TMS_RAY_VENV"),
            virtual_env: nonempty("VIRTUAL_ENV"),
            path: nonempty("PATH"),
            cache,
        }
    }
}

/// The Python the Ray launcher uses, or why there is none (naming every place looked at, and the fix).
pub(in crate::run) fn choose(cfg: &Config) -> Result<RayPython, String> {
    choose_in(&Places::from_env(cfg))
}

fn choose_in(places: &Places) -> Result<RayPython, String> {
    if !places.explicit.is_empty() {
        return explicit(PathBuf::from(&places.explicit), "run.ray_python");
    }
    if let Some(v) = &places.ray_venv {
        return explicit(PathBuf::from(v).join("bin/python"), "$TMS_RAY_VENV");
    }
    let mut tried = vec!["run.ray_python: not set".to_string(), "$TMS_RAY_VENV: not set".to_string()];
    let mut seen: Vec<PathBuf> = Vec::new();
    // The same file by another path is asked once. Only the folder is resolved: a virtual
    // environment's python is a link to the base interpreter, and it is the link's place that
    // makes it the environment's.
    let mut first_seen = |p: &Path| {
        let dir = p.parent().and_then(|d| std::fs::canonicalize(d).ok());
        let key = dir.map_or_else(|| p.to_path_buf(), |d| d.join(p.file_name().unwrap_or_default()));
        let new = !seen.contains(&key);
        seen.push(key);
        new
    };
    match &places.virtual_env {
        Some(v) => {
            let py = PathBuf::from(v).join("bin/python");
            if !py.is_file() {
                tried.push(format!("$VIRTUAL_ENV's {}: not there", py.display()));
            } else if first_seen(&py) {
                match probe(&py) {
                    Ok((ray, python)) => {
                        return Ok(chosen(py, "the active virtual environment ($VIRTUAL_ENV)", ray, python));
                    }
                    Err(e) => tried.push(format!("$VIRTUAL_ENV's {}: {e}", py.display())),
                }
            }
        }
        None => tried.push("$VIRTUAL_ENV: not set".into()),
    }
    let mut on_path = 0;
    for dir in places.path.iter().flat_map(std::env::split_paths) {
        for name in ["python3", "python"] {
            let py = dir.join(name);
            if !py.is_file() || !first_seen(&py) {
                continue;
            }
            on_path += 1;
            match probe(&py) {
                Ok((ray, python)) => {
                    return Ok(chosen(py, &format!("the first {name} on PATH that imports ray"), ray, python));
                }
                Err(e) => tried.push(format!("{} (PATH): {e}", py.display())),
            }
        }
    }
    if on_path == 0 {
        tried.push("PATH: no python3 or python".into());
    }
    let pinned = places.cache.join("tms/ray-venv/bin/python");
    if !pinned.is_file() {
        tried.push(format!("the pinned environment {}: not there", pinned.display()));
    } else if first_seen(&pinned) {
        match probe(&pinned) {
            Ok((ray, python)) => {
                return Ok(chosen(pinned, "the pinned environment of scripts/ray-env.sh", ray, python));
            }
            Err(e) => tried.push(format!("the pinned environment {}: {e}", pinned.display())),
        }
    }
    Err(format!("--launcher ray needs a Python that can import ray, and none was found: {}. {FIX}", tried.join("; ")))
}

fn chosen(path: PathBuf, why: &str, ray: String, python: String) -> RayPython {
    RayPython { path, why: why.to_string(), ray, python }
}

/// A Python the user named: it is used or the run stops, never replaced by another.
fn explicit(py: PathBuf, key: &str) -> Result<RayPython, String> {
    let why = format!("{key} (explicit)");
    let cause = if py.is_file() {
        match probe(&py) {
            Ok((ray, python)) => return Ok(chosen(py, &why, ray, python)),
            Err(e) => e,
        }
    } else {
        "not there".to_string()
    };
    Err(format!("--launcher ray: {key} gives {}, and it cannot be used: {cause}. {FIX}", py.display()))
}

/// Asks `py` for its Ray's version and its own: Ok((ray, python)), or why it cannot.
fn probe(py: &Path) -> Result<(String, String), String> {
    let child = Command::new(py)
        .args(["-c", PROBE])
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run it ({e})"))?;
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    // The output is read to its end by the waiting thread, so a chatty Python cannot fill a pipe
    // and stall while the time limit runs.
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let out = match rx.recv_timeout(PROBE_LIMIT) {
        Ok(out) => out.map_err(|e| format!("cannot run it ({e})"))?,
        Err(_) => {
            // SAFETY: signalling the child started above, which the thread has not reaped (it is
            // still waiting for it).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let _ = rx.recv();
            return Err(format!("`import ray` did not finish within {}s", PROBE_LIMIT.as_secs()));
        }
    };
    let last = |b: &[u8]| String::from_utf8_lossy(b).lines().rev().find(|l| !l.trim().is_empty()).map(str::to_string);
    if !out.status.success() {
        let why = last(&out.stderr).unwrap_or_else(|| out.status.to_string());
        return Err(format!("cannot import ray ({})", why.trim()));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    match lines[..] {
        [.., ray, python] => Ok((ray.to_string(), python.to_string())),
        _ => Err(format!("it imported ray but did not print its version: {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in Python: prints `ray` and `python` as the probe would, or fails as one without Ray.
    fn fake_python(dir: &Path, name: &str, ray: Option<&str>) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let p = dir.join(name);
        let body = match ray {
            Some(v) => format!("#!/bin/sh\necho {v}\necho 3.11.7\n"),
            None => "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'ray'\" >&2\nexit 1\n".into(),
        };
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// These tests write stand-in Pythons and run them: a test forking its probe while another
    /// still holds its script open for writing would make that script's exec fail with ETXTBSY,
    /// so they take turns.
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn turn() -> std::sync::MutexGuard<'static, ()> {
        TURN.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn places(t: &Path) -> Places {
        Places { cache: t.join("cache"), ..Places::default() }
    }

    #[test]
    fn the_first_python_on_path_that_imports_ray_comes_before_the_pinned_environment() {
        let _turn = turn();
        let t = tempfile::tempdir().unwrap();
        fake_python(&t.path().join("cache/tms/ray-venv/bin"), "python", Some("2.58.1"));
        fake_python(&t.path().join("a"), "python3", None);
        let b = fake_python(&t.path().join("b"), "python", Some("2.40.0"));
        let mut pl = places(t.path());
        pl.path = Some(std::env::join_paths([t.path().join("a"), t.path().join("b")]).unwrap());
        let got = choose_in(&pl).unwrap();
        assert_eq!((got.path.as_path(), got.ray.as_str()), (b.as_path(), "2.40.0"), "{got:?}");
        assert_eq!(got.why, "the first python on PATH that imports ray");
        assert_eq!(got.python, "3.11.7");
    }

    #[test]
    fn the_active_virtual_environment_comes_before_path_and_explicit_choices_before_both() {
        let _turn = turn();
        let t = tempfile::tempdir().unwrap();
        let venv = fake_python(&t.path().join("venv/bin"), "python", Some("2.50.0"));
        fake_python(&t.path().join("a"), "python3", Some("2.40.0"));
        let mut pl = places(t.path());
        pl.path = Some(t.path().join("a").into());
        pl.virtual_env = Some(t.path().join("venv").into());
        let got = choose_in(&pl).unwrap();
        assert_eq!((got.path, got.why.as_str()), (venv, "the active virtual environment ($VIRTUAL_ENV)"));
        let own = fake_python(&t.path().join("own/bin"), "python", Some("2.9.0"));
        pl.ray_venv = Some(t.path().join("own").into());
        let got = choose_in(&pl).unwrap();
        assert_eq!((got.path, got.why.as_str()), (own, "$TMS_RAY_VENV (explicit)"));
        let named = fake_python(&t.path().join("x"), "py", Some("2.1.0"));
        pl.explicit = named.display().to_string();
        let got = choose_in(&pl).unwrap();
        assert_eq!((got.path, got.ray.as_str()), (named, "2.1.0"));
    }

    #[test]
    fn an_explicit_python_without_ray_stops_the_run_instead_of_falling_back() {
        let _turn = turn();
        let t = tempfile::tempdir().unwrap();
        fake_python(&t.path().join("a"), "python3", Some("2.40.0"));
        let bad = fake_python(&t.path().join("x"), "python", None);
        let mut pl = places(t.path());
        pl.path = Some(t.path().join("a").into());
        pl.explicit = bad.display().to_string();
        let err = choose_in(&pl).unwrap_err();
        assert!(err.contains("run.ray_python gives") && err.contains("No module named 'ray'"), "{err}");
        pl.explicit.clear();
        pl.ray_venv = Some(t.path().join("absent").into());
        let err = choose_in(&pl).unwrap_err();
        assert!(err.contains("$TMS_RAY_VENV gives") && err.contains("absent/bin/python") && err.contains("not there"));
    }

    #[test]
    fn no_python_with_ray_anywhere_names_every_place_looked_at_and_the_fix() {
        let _turn = turn();
        let t = tempfile::tempdir().unwrap();
        let a = fake_python(&t.path().join("a"), "python3", None);
        let mut pl = places(t.path());
        pl.path = Some(t.path().join("a").into());
        pl.virtual_env = Some(t.path().join("venv").into());
        let err = choose_in(&pl).unwrap_err();
        for part in [
            "run.ray_python: not set",
            "$TMS_RAY_VENV: not set",
            "$VIRTUAL_ENV's",
            &format!("{} (PATH): cannot import ray (ModuleNotFoundError: No module named 'ray')", a.display()),
            &format!("the pinned environment {}: not there", t.path().join("cache/tms/ray-venv/bin/python").display()),
            "scripts/ray-env.sh",
            "pip install ray",
        ] {
            assert!(err.contains(part), "{part:?} not in: {err}");
        }
    }

    #[test]
    fn a_python_that_prints_no_version_is_not_taken_for_one_with_ray() {
        let _turn = turn();
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("python3");
        std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(probe(&p).unwrap_err().contains("did not print its version"));
    }
}
