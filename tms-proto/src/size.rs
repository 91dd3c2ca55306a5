//! Byte sizes as people write them, one rule for every tms command line and configuration:
//! `KiB`/`MiB`/`GiB`/`TiB` (and `Ki`, `Mi`, ...) are powers of 1024, `KB`/`MB`/`GB`/`TB` powers
//! of 1000, as the units say; a bare `K`/`M`/`G`/`T` is binary, as `16G` means 16 GiB to anyone
//! sizing GPU memory. Parsing is the `bytesize` crate's; this module adds the bare-letter rule
//! and refuses sizes that do not fit in 64 bits instead of saturating.

use bytesize::ByteSize;

/// Parses `512MiB`, `1.5 GiB`, `1GB` (10^9), `16G` (16 GiB), `4096` (bytes).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let hint = "a size like 4096, 512MiB, 1.5GiB or 1GB (GB = 10^9 bytes, GiB = 2^30)";
    if t.is_empty() || t.starts_with('-') {
        return Err(format!("{text:?} is not {hint}"));
    }
    let unit_at = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(unit_at);
    let unit = unit.trim();
    let plain_bytes = unit.is_empty() || unit.eq_ignore_ascii_case("b");
    if plain_bytes && !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()) {
        return number.parse::<u64>().map_err(|_| format!("{text:?} is too large (at most {} bytes)", u64::MAX));
    }
    let binary_letter = matches!(unit.to_ascii_lowercase().as_str(), "k" | "m" | "g" | "t" | "p");
    let spelled = if binary_letter { format!("{number}{unit}iB") } else { format!("{number}{unit}") };
    let size: ByteSize = spelled.parse().map_err(|_| format!("{text:?} is not {hint}"))?;
    // bytesize saturates at u64::MAX; a size that large is a typo, not a request.
    if size.as_u64() == u64::MAX {
        return Err(format!("{text:?} is too large (at most 16 EiB)"));
    }
    Ok(size.as_u64())
}

/// `1.5 GiB`, `78.8 MiB`, `512 B`: binary units, one decimal.
pub fn format_size(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

/// `before -> after` of a quantity that moved, with the change itself when there was one
/// (`72.3 GiB -> 72.3 GiB (+24.0 MiB)`): each side alone is rounded to a tenth of its unit, which
/// on a large device hides a change of tens of MiB.
pub fn format_change(before: u64, after: u64) -> String {
    let change = match after.cmp(&before) {
        std::cmp::Ordering::Equal => return format!("{} -> {}", format_size(before), format_size(after)),
        std::cmp::Ordering::Greater => format!("+{}", format_size(after - before)),
        std::cmp::Ordering::Less => format!("-{}", format_size(before - after)),
    };
    format!("{} -> {} ({change})", format_size(before), format_size(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_mean_what_they_say() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1gb"), Ok(1_000_000_000));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn a_change_smaller_than_the_rounding_is_still_shown() {
        let g = 72 * (1u64 << 30) + (3 << 29) / 5;
        assert_eq!(format_change(g, g + (24 << 20)), "72.3 GiB -> 72.3 GiB (+24.0 MiB)");
        assert_eq!(format_change(1 << 30, 0), "1.0 GiB -> 0 B (-1.0 GiB)");
        assert_eq!(format_change(4096, 4096), "4.0 KiB -> 4.0 KiB");
    }

    #[test]
    fn nonsense_and_overflow_are_refused_with_the_rule() {
        for bad in ["", "-1", "lots", "1XB", "1.2.3GiB", "GiB"] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.contains("GiB = 2^30"), "{bad}: {err}");
        }
        assert!(parse_size("99999999999EiB").unwrap_err().contains("too large"));
        assert!(parse_size("18446744073709551616").unwrap_err().contains("too large"));
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size(512), "512 B");
        assert_eq!(parse_size(&format_size(256 << 20)), Ok(256 << 20));
    }
}
