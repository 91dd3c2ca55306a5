//! The benchmark's plots: pause/resume time against bytes and against the number of allocations,
//! backup throughput against the raw pinned copy of the same run, and the collective row's broadcast
//! against its modelled link, on log axes.

use crate::plot::{Axis, Chart, Quantity, Series, Shape, color, svg};
use serde_json::Value;
use std::path::Path;

fn series(
    rows: &[Value],
    filter: impl Fn(&Value) -> bool,
    x: &str,
    y: &str,
    scale: f64,
    name: &str,
    i: usize,
) -> Series {
    Series {
        name: name.to_string(),
        points: rows
            .iter()
            .filter(|r| filter(r))
            .map(|r| (r[x].as_f64().unwrap_or(0.0), r[y].as_f64().unwrap_or(0.0) * scale))
            .collect(),
        shape: Shape::Marked,
        color: color(i),
        width: 2,
    }
}

fn chart(title: &str, x: Axis, y: Axis, series: Vec<Series>) -> String {
    svg(&Chart { title: title.into(), width: 820, height: 460, x: Some(x), y: Some(y), series, ..Chart::default() })
}

/// Time against bytes, and the backup's throughput against the raw pinned copy.
pub fn write_bytes(dir: &Path, bytes_rows: &[Value]) -> std::io::Result<()> {
    let with = |b: bool| move |r: &Value| r["backup"].as_bool() == Some(b);
    let by_bytes = vec![
        series(bytes_rows, with(false), "bytes", "pause_ns", 1e-9, "pause", 0),
        series(bytes_rows, with(false), "bytes", "resume_ns", 1e-9, "resume", 1),
        series(bytes_rows, with(true), "bytes", "pause_ns", 1e-9, "pause + backup", 2),
        series(bytes_rows, with(true), "bytes", "resume_ns", 1e-9, "resume + restore", 3),
    ];
    let size = || Axis::log("allocation size", Quantity::Bytes);
    let time = || Axis::log("time", Quantity::Seconds);
    std::fs::write(dir.join("time_vs_bytes.svg"), chart("Pause/resume time vs bytes", size(), time(), by_bytes))?;
    let throughput = vec![
        series(bytes_rows, with(true), "bytes", "pause_bytes_per_s", 1.0, "pause backup", 0),
        series(bytes_rows, with(true), "bytes", "raw_d2h_bytes_per_s", 1.0, "raw D2H copy", 1),
        series(bytes_rows, with(true), "bytes", "resume_bytes_per_s", 1.0, "resume restore", 2),
        series(bytes_rows, with(true), "bytes", "raw_h2d_bytes_per_s", 1.0, "raw H2D copy", 3),
    ];
    std::fs::write(
        dir.join("throughput_vs_limit.svg"),
        chart("Backup throughput vs raw pinned copy", size(), Axis::log("throughput", Quantity::Rate), throughput),
    )
}

/// Time against the number of allocations.
pub fn write_count(dir: &Path, count_rows: &[Value]) -> std::io::Result<()> {
    let all = |_: &Value| true;
    let by_count = vec![
        series(count_rows, all, "allocations", "pause_ns", 1e-9, "pause", 0),
        series(count_rows, all, "allocations", "resume_ns", 1e-9, "resume", 1),
    ];
    let time = Axis::log("time", Quantity::Seconds);
    std::fs::write(
        dir.join("time_vs_count.svg"),
        chart("Pause/resume time vs allocations", Axis::log("allocations", Quantity::Count), time, by_count),
    )
}

/// The collective row: the broadcast's rate against the modelled link, per size.
pub fn write_collective(dir: &Path, rows: &[Value]) -> std::io::Result<()> {
    let all = |_: &Value| true;
    let mut lines = vec![series(rows, all, "bytes", "bytes_per_s", 1.0, "ncclBroadcast (bytes / time)", 0)];
    if rows.iter().any(|r| r["link_bytes_per_s"].is_number()) {
        lines.push(series(rows, all, "bytes", "link_bytes_per_s", 1.0, "modelled link", 1));
    }
    let size = Axis::log("broadcast size", Quantity::Bytes);
    std::fs::write(
        dir.join("broadcast_vs_link.svg"),
        chart(
            "Broadcast between two devices vs the modelled link",
            size,
            Axis::log("throughput", Quantity::Rate),
            lines,
        ),
    )
}
