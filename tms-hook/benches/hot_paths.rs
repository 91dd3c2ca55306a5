//! Hot paths of the hook, in process: the region decision every intercepted allocation makes,
//! registry insert/lookup/remove as frees and backup-pointer queries use them, tag interning, and
//! the cached forwarding lookup. `cargo bench -p tms-hook`.

use criterion::{Criterion, black_box, criterion_group, criterion_main};
use tms_hook::device::Vendor;
use tms_hook::registry::{Allocation, Piece, Registry, State};

fn entry(tag: u32) -> Allocation {
    Allocation {
        size: 2 << 20,
        rounded: 2 << 20,
        piece_len: 2 << 20,
        device: 0,
        vendor: Vendor::Cuda,
        mem_kind: 0,
        tag,
        backup_enabled: false,
        pageable_backup: false,
        state: State::Active,
        pieces: vec![Piece { handle: Some(1), mapped: true }],
        backup: None,
        backup_valid: false,
        backup_retained: false,
        backup_sums: None,
        disk: false,
        disk_file: None,
        doomed: false,
        dead: Vec::new(),
        live: None,
    }
}

fn hot_paths(c: &mut Criterion) {
    c.bench_function("region decision (thread flag)", |b| b.iter(|| black_box(tms_hook::region::in_region())));
    tms_hook::region::set_region(true);
    c.bench_function("region decision (flag set)", |b| b.iter(|| black_box(tms_hook::region::in_region())));
    c.bench_function("current tag", |b| b.iter(|| black_box(tms_hook::region::current_tag())));

    let mut reg = Registry::default();
    for i in 0..10_000u64 {
        reg.map.insert(0x7f00_0000_0000 + i * (2 << 20), entry(0));
    }
    let probe = 0x7f00_0000_0000 + 5_000 * (2 << 20) + 4096;
    c.bench_function("registry lookup in 10,000 (containing)", |b| {
        b.iter(|| black_box(reg.containing(black_box(probe)).is_some()))
    });
    c.bench_function("registry insert+remove at 10,000", |b| {
        b.iter(|| {
            let addr = 0x7e00_0000_0000u64;
            reg.map.insert(addr, entry(1));
            black_box(reg.map.remove(&addr));
        })
    });
    c.bench_function("forward lookup with no runtime loaded (uncached miss)", |b| {
        b.iter(|| black_box(tms_hook::forward::CUDA_FREE.resolve(0)))
    });
}

criterion_group!(benches, hot_paths);
criterion_main!(benches);
