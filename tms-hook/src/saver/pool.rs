//! The pinned-pool policy: which host buffers resumed allocations keep.
//!
//! A resumed allocation's buffer stays for the next pause if retained (its snapshot is still
//! handed out) or pooled (it is not: the next pause skips pinning it again). Pooled buffers hold
//! host memory while their allocations are active: at most TMS_PINNED_POOL_MAX_MB of them stay,
//! and only while the host keeps its reserve available; the rest are freed (and pinned again next
//! pause).

use super::pieces::free_host_buf;
use super::{Job, Saver, lock};
use crate::config::config;
use crate::host_memory;
use crate::registry::State;

/// Whether a resumed job's buffer would be pooled rather than retained or freed anyway.
fn pooled(j: &Job, retain: bool) -> bool {
    !retain && !j.a.disk && !j.a.pageable_backup && j.a.backup.is_some()
}

/// Takes room in the pool for `j`'s buffer where it would be pooled; false when it does not fit.
fn fits(room: &mut Option<u64>, j: &Job, retain: bool) -> bool {
    match (room, j.a.backup) {
        (Some(room), Some(b)) if pooled(j, retain) => {
            let ok = b.len as u64 <= *room;
            if ok {
                *room -= b.len as u64;
            }
            ok
        }
        _ => true,
    }
}

impl Saver {
    /// Keeps or frees the host buffers of the jobs resumed (`ok`), `retain` being the saver's
    /// retention setting at the time.
    pub(super) fn keep_or_free_buffers(&self, jobs: &mut [Job], retain: bool) {
        let keep = retain || config().keep_pinned;
        let mut room = if keep { self.pool_room(jobs, retain) } else { None };
        for j in jobs.iter_mut().filter(|j| j.ok) {
            let fits = fits(&mut room, j, retain);
            // A disk-backed allocation's staging buffer goes: its contents live on disk, not here.
            // A pageable backup goes too unless retained: the "mmap" backend is chosen to give
            // host memory back.
            if (!keep || !fits || j.a.disk || (j.a.pageable_backup && !j.a.backup_retained))
                && let Some(b) = j.a.backup.take()
                && let Some(dev) = self.loaded(j.a.vendor)
            {
                free_host_buf(dev.as_ref(), b);
            }
        }
    }

    /// Host bytes the pool may still take for the buffers of these jobs (None: no limit applies,
    /// none of them would be pooled).
    fn pool_room(&self, jobs: &[Job], retain: bool) -> Option<u64> {
        let candidates: u64 =
            jobs.iter().filter(|j| j.ok && pooled(j, retain)).filter_map(|j| j.a.backup).map(|b| b.len as u64).sum();
        if candidates == 0 {
            return None;
        }
        let host = host_memory::pool_room(candidates, config().pinned_pool_host_reserve_percent);
        let capped = config().pinned_pool_max.map(|max| max.saturating_sub(self.pooled_bytes()));
        Some(capped.map_or(host, |c| c.min(host)))
    }

    /// Host bytes of pinned buffers pooled by active allocations (kept for their next pause, not
    /// handed out).
    pub fn pooled_bytes(&self) -> u64 {
        lock(&self.registry)
            .map
            .values()
            .filter(|a| a.state == State::Active && !a.backup_retained && !a.pageable_backup)
            .filter_map(|a| a.backup.map(|b| b.len as u64))
            .sum()
    }
}
