//! How much host memory the machine has left, for deciding what pinned buffers to keep pooled.

/// `(MemAvailable, MemTotal)` in bytes from /proc/meminfo; None where it cannot be read.
pub fn available_and_total() -> Option<(u64, u64)> {
    parse(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kib << 10)
        })
    };
    Some((field("MemAvailable")?, field("MemTotal")?))
}

/// Bytes of `candidates` (pinned bytes that a resume could keep pooled, already counted as used
/// by the kernel) that can stay while `reserve_percent` of the host's memory stays available.
/// Unknown host memory keeps them all: the explicit cap still applies.
pub fn pool_room(candidates: u64, reserve_percent: u64) -> u64 {
    match available_and_total() {
        Some((available, total)) => room(candidates, available, total, reserve_percent),
        None => candidates,
    }
}

fn room(candidates: u64, available: u64, total: u64, reserve_percent: u64) -> u64 {
    let reserve = (total as u128 * reserve_percent.min(100) as u128 / 100) as u64;
    candidates.saturating_sub(reserve.saturating_sub(available))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_available_and_total_from_meminfo_text() {
        let text = "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12288000 kB\n";
        assert_eq!(parse(text), Some((12_288_000 << 10, 24_576_000 << 10)));
        assert_eq!(parse("MemTotal: 5 kB\n"), None);
        assert!(available_and_total().is_some_and(|(a, t)| a <= t && t > 0));
    }

    #[test]
    fn buffers_go_until_the_reserve_is_available_again() {
        const GIB: u64 = 1 << 30;
        // 24 GiB host, 25 % reserve = 6 GiB: with 10 GiB available, 9 GiB of buffers all stay.
        assert_eq!(room(9 * GIB, 10 * GIB, 24 * GIB, 25), 9 * GIB);
        // With 2 GiB available, 4 GiB must be given back: 5 of the 9 stay.
        assert_eq!(room(9 * GIB, 2 * GIB, 24 * GIB, 25), 5 * GIB);
        assert_eq!(room(3 * GIB, 2 * GIB, 24 * GIB, 25), 0);
        assert_eq!(room(9 * GIB, 0, 24 * GIB, 0), 9 * GIB);
        assert_eq!(room(9 * GIB, 23 * GIB, 24 * GIB, 100), 8 * GIB);
    }
}
