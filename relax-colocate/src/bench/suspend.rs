//! The communicator row: what pausing the hook's tag `nccl` wins on each rank of the collective
//! row's 2-rank NCCL communicator, the memory a colocated trainer's process group gives the
//! rollout while it sleeps (`relax-colocate run` suspends it with the trainer's other memory).
//!
//! Each rank (under the hook, with the broadcasts done) reads ncclCommMemStats' suspendable and
//! persistent bytes, pauses tag `nccl` through `tms_pause_report` with the device's free memory
//! read around it, resumes it, and broadcasts once more on the resumed communicator: rank 0's
//! bytes must arrive. Skipped, saying why, where the hook is not loaded or NCCL predates
//! ncclCommMemStats (2.29.7).

use super::table::{Target, f, human, table};
use crate::collective::Group;
use crate::runtime::{Report, Runtime, Tms, check};
use serde_json::{Value, json};

const MIB: usize = 1 << 20;
/// ncclStatGpuMemSuspend and ncclStatGpuMemPersist.
const STAT_SUSPENDABLE: i32 = 0;
const STAT_PERSISTENT: i32 = 2;
const TARGET: &str = "pause of tag nccl frees ncclCommMemStats' suspendable bytes on every rank";

/// One rank's figures (the collective row's worker, after its broadcasts).
pub(super) fn measure(rt: &Runtime, group: &Group) -> Result<Value, String> {
    let Ok(tms) = Tms::load() else {
        return Ok(json!({ "skipped": "libtms_hook.so is not preloaded in the rank" }));
    };
    let (Some(suspendable), Some(persistent)) =
        (group.nccl_mem_stat(STAT_SUSPENDABLE), group.nccl_mem_stat(STAT_PERSISTENT))
    else {
        return Ok(json!({ "skipped": "this NCCL has no ncclCommMemStats (NCCL 2.29.7 or later)" }));
    };
    let free = || -> Result<u64, String> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes.
        check("cudaMemGetInfo", unsafe { (rt.mem_get_info)(&mut free, &mut total) })?;
        Ok(free as u64)
    };
    let before = free()?;
    let paused = op(&tms, true)?;
    let asleep = free()?;
    let resumed = op(&tms, false)?;
    let awake = free()?;
    let intact = broadcast_once(rt, group)?;
    Ok(json!({
        "rank": group.rank, "suspendable_bytes": suspendable, "persistent_bytes": persistent,
        "paused_bytes": paused.bytes_done, "paused_communicators": paused.allocations_done,
        "pause_ns": paused.elapsed_ns, "resume_ns": resumed.elapsed_ns,
        "free_rose_bytes": asleep.saturating_sub(before), "free_fell_on_resume_bytes": asleep.saturating_sub(awake),
        "broadcast_after_resume_intact": intact,
    }))
}

/// tms_pause_report / tms_resume_report of tag `nccl`.
fn op(tms: &Tms, pause: bool) -> Result<Report, String> {
    let mut r = Report::default();
    // SAFETY: the hook's C API with a NUL-terminated tag and a valid report.
    let rc =
        unsafe { if pause { (tms.pause)(c"nccl".as_ptr(), &mut r) } else { (tms.resume)(c"nccl".as_ptr(), &mut r) } };
    check(if pause { "tms_pause_report(\"nccl\")" } else { "tms_resume_report(\"nccl\")" }, rc)?;
    Ok(r)
}

/// One 1 MiB broadcast from rank 0 on the resumed communicator; whether its bytes arrived.
fn broadcast_once(rt: &Runtime, group: &Group) -> Result<bool, String> {
    let mut buf = std::ptr::null_mut();
    let fill = if group.rank == 0 { 0xa5 } else { 0 };
    // SAFETY: runtime calls on a buffer of MIB bytes made here.
    unsafe {
        check("cudaMalloc", (rt.malloc)(&mut buf, MIB))?;
        check("cudaMemset", (rt.memset)(buf, fill, MIB))?;
    }
    let sent = group.broadcast(buf as u64, MIB, 0).and_then(|()| group.synchronize());
    let mut host = vec![0u8; MIB];
    // SAFETY: MIB bytes device to host (kind 2), then the buffer freed.
    let copied = unsafe { check("cudaMemcpy", (rt.memcpy)(host.as_mut_ptr().cast(), buf, MIB, 2)) };
    check("cudaFree", unsafe { (rt.free)(buf) })?;
    sent?;
    copied?;
    Ok(host.iter().all(|&b| b == 0xa5))
}

/// Both ranks' figures: the row's JSON, its table and its target (none when skipped).
pub(super) fn report(ranks: &[Value]) -> (Value, Option<Target>) {
    let rows: Vec<Value> = ranks.iter().map(|r| r["suspend"].clone()).collect();
    if let Some(why) = rows.iter().find_map(|r| r["skipped"].as_str().map(String::from)) {
        println!("\nCommunicator suspend (tag nccl): skipped ({why})");
        return (json!({ "skipped": why }), None);
    }
    println!(
        "\nCommunicator suspend: tms_pause(\"nccl\") on each rank of the 2-rank NCCL communicator above, \
         the memory a\ncolocated trainer's process group gives back while it sleeps (ncclCommSuspend; \
         ncclCommMemStats' figures)"
    );
    let ms = |r: &Value, k: &str| format!("{:.3}", f(r, k) / 1e6);
    let lines = rows
        .iter()
        .map(|r| {
            vec![
                r["rank"].to_string(),
                human(f(r, "suspendable_bytes")),
                human(f(r, "paused_bytes")),
                human(f(r, "free_rose_bytes")),
                human(f(r, "persistent_bytes")),
                ms(r, "pause_ns"),
                ms(r, "resume_ns"),
                (if r["broadcast_after_resume_intact"] == true { "yes" } else { "NO" }).to_string(),
            ]
        })
        .collect();
    let head = ["rank", "suspendable", "suspended", "free rose", "kept", "pause ms", "resume ms", "bcast after"];
    println!("{}", table(&head, lines));
    let won = |r: &Value| {
        let s = f(r, "suspendable_bytes");
        s > 0.0
            && f(r, "paused_bytes") == s
            && f(r, "free_rose_bytes") >= s
            && r["broadcast_after_resume_intact"] == true
    };
    let per_rank: Vec<String> = rows.iter().map(|r| human(f(r, "paused_bytes"))).collect();
    let target = (TARGET, format!("{} per rank", per_rank.join(", ")), rows.iter().all(won));
    let bytes_won: Vec<Value> = rows.iter().map(|r| r["paused_bytes"].clone()).collect();
    (json!({ "ranks": rows, "bytes_won_per_rank": bytes_won }), Some(target))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(paused: u64, rose: u64, intact: bool) -> Value {
        json!({ "suspend": { "rank": 0, "suspendable_bytes": 16 << 20, "persistent_bytes": 1 << 20,
            "paused_bytes": paused, "free_rose_bytes": rose, "pause_ns": 1e5, "resume_ns": 1e5,
            "broadcast_after_resume_intact": intact } })
    }

    #[test]
    fn the_target_needs_every_rank_to_free_its_suspendable_bytes_and_broadcast_after() {
        let full = 16 << 20;
        assert!(report(&[rank(full, full, true), rank(full, full + 4096, true)]).1.unwrap().2);
        assert!(!report(&[rank(full, full, true), rank(full, full - 1, true)]).1.unwrap().2);
        assert!(!report(&[rank(full, full, true), rank(0, 0, true)]).1.unwrap().2);
        assert!(!report(&[rank(full, full, false), rank(full, full, true)]).1.unwrap().2);
        let (row, target) = report(&[json!({ "suspend": { "skipped": "no hook" } }), rank(full, full, true)]);
        assert!(target.is_none() && row["skipped"] == "no hook");
    }
}
