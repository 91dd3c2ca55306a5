//! cudarc-runtime-consumer MIB: allocates MIB MiB with cudaMalloc (through cudarc), fills it with
//! a known pattern, prints `ready bytes=N free=F`, then answers one line per command on stdin:
//! `info` (free device memory), `check` (reads the buffer back and compares every byte), `quit`.
//! Every reply starts with `ok` or `error`.

use cudarc::runtime::result;
use std::io::{BufRead, Write};

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(131) ^ (i >> 12)) as u8).collect()
}

fn main() {
    let mib: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(16);
    let len = mib << 20;
    let count = result::device::get_count().expect("cudaGetDeviceCount");
    assert!(count > 0, "no CUDA device");
    let expected = pattern(len);
    // SAFETY: a fresh allocation of `len` bytes, written whole before it is read.
    let ptr = unsafe { result::malloc_sync(len) }.expect("cudaMalloc");
    unsafe { result::memcpy_htod_sync(ptr, &expected) }.expect("cudaMemcpy host to device");
    let free = || result::get_mem_info().map(|(free, _)| free).expect("cudaMemGetInfo");
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready bytes={len} free={} devices={count}", free()).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        match line.trim() {
            "info" => writeln!(out, "ok free={}", free()).unwrap(),
            "check" => {
                let mut back = vec![0u8; len];
                match unsafe { result::memcpy_dtoh_sync(&mut back, ptr) } {
                    Err(e) => writeln!(out, "error cudaMemcpy device to host: {e:?}").unwrap(),
                    Ok(()) => match back.iter().zip(&expected).position(|(a, b)| a != b) {
                        None => writeln!(out, "ok identical bytes={len}").unwrap(),
                        Some(i) => writeln!(out, "error first differing byte at {i} of {len}").unwrap(),
                    },
                }
            }
            "quit" => break,
            other => writeln!(out, "error unknown command {other:?}").unwrap(),
        }
        out.flush().unwrap();
    }
    // SAFETY: the allocation made above, freed once.
    unsafe { result::free_sync(ptr) }.expect("cudaFree");
}
