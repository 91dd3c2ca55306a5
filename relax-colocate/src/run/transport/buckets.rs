//! How every transport cuts the weights stream (the weights' entries laid end to end, in layout
//! order) into buckets of `bucket_bytes`: the runner and the workers, ours and
//! scripts/torch_worker.py's, must agree on it (the golden cases in compute.rs hold both to it).

/// A stretch of a bucket: (entry, offset in the entry, offset in the bucket, length).
pub(in crate::run) type Piece = (usize, u64, u64, u64);

/// How many buckets of `bucket_bytes` carry `total` bytes of weights (the last may be short).
pub(in crate::run) fn bucket_count(total: u64, bucket_bytes: u64) -> u64 {
    total.div_ceil(bucket_bytes)
}

/// The pieces of bucket `i` when entries of `sizes` bytes, laid end to end, are cut every
/// `bucket_bytes`: (entry, offset in the entry, offset in the bucket, length). Empty past the end.
pub(in crate::run) fn bucket_pieces(sizes: &[u64], bucket_bytes: u64, i: u64) -> Vec<Piece> {
    let (start, end) = (i * bucket_bytes, (i + 1) * bucket_bytes);
    let mut pieces = Vec::new();
    let mut at = 0u64;
    for (idx, &n) in sizes.iter().enumerate() {
        let (lo, hi) = (at.max(start), (at + n).min(end));
        if lo < hi {
            pieces.push((idx, lo - at, lo - start, hi - lo));
        }
        at += n;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cut_across_entries_and_cover_every_byte_once() {
        let sizes = [10, 3, 7];
        let pieces: Vec<_> = (0..3).map(|b| bucket_pieces(&sizes, 8, b)).collect();
        assert_eq!(pieces[0], vec![(0, 0, 0, 8)]);
        assert_eq!(pieces[1], vec![(0, 8, 0, 2), (1, 0, 2, 3), (2, 0, 5, 3)]);
        assert_eq!(pieces[2], vec![(2, 3, 0, 4)]);
        assert!(bucket_pieces(&sizes, 8, 3).is_empty());
        let covered: u64 = pieces.iter().flatten().map(|p| p.3).sum();
        assert_eq!(covered, 20);
    }
}
