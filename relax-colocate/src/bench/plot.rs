//! Small dependency-free SVG line plots (log-log) for the benchmark.

use serde_json::Value;
use std::fmt::Write as _;
use std::path::Path;

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// A log-log line plot with axis labels and a legend.
pub fn svg(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 440.0, 80.0, 200.0, 40.0, 60.0);
    let pts: Vec<(f64, f64)> =
        series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| *x > 0.0 && *y > 0.0).collect();
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" font-size="15" text-anchor="middle">{title}</text>"#,
        w / 2.0
    );
    if pts.is_empty() {
        out.push_str("</svg>");
        return out;
    }
    let lx = |v: f64| v.log10();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in &pts {
        x0 = x0.min(lx(*x));
        x1 = x1.max(lx(*x));
        y0 = y0.min(lx(*y));
        y1 = y1.max(lx(*y));
    }
    let (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    let (y0, y1) = (y0.floor(), y1.ceil().max(y0.floor() + 1.0));
    let pw = w - left - right;
    let ph = h - top - bottom;
    let px = |x: f64| left + (lx(x) - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + ph - (lx(y) - y0) / (y1 - y0) * ph;
    let _ = write!(out, r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##);
    for e in x0 as i32..=x1 as i32 {
        let x = left + (e as f64 - x0) / (x1 - x0) * pw;
        let _ = write!(
            out,
            r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">1e{e}</text>"##,
            top + ph,
            top + ph + 16.0
        );
    }
    for e in y0 as i32..=y1 as i32 {
        let y = top + ph - (e as f64 - y0) / (y1 - y0) * ph;
        let _ = write!(
            out,
            r##"<line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">1e{e}</text>"##,
            left + pw,
            left - 6.0,
            y + 4.0
        );
    }
    let _ = write!(out, r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#, left + pw / 2.0, h - 16.0);
    let _ = write!(
        out,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">{y_label}</text>"#,
        top + ph / 2.0,
        top + ph / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = s
            .points
            .iter()
            .filter(|(x, y)| *x > 0.0 && *y > 0.0)
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let _ = write!(out, r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for p in &path {
            let (cx, cy) = p.split_once(',').expect("x,y");
            let _ = write!(out, r#"<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>"#);
        }
        let ly = top + 16.0 + i as f64 * 20.0;
        let _ = write!(
            out,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            left + pw + 12.0,
            left + pw + 36.0,
            left + pw + 42.0,
            ly + 4.0,
            s.name
        );
    }
    out.push_str("</svg>\n");
    out
}

fn series(rows: &[Value], filter: impl Fn(&Value) -> bool, x: &str, y: &str, scale: f64, name: &str) -> Series {
    Series {
        name: name.to_string(),
        points: rows
            .iter()
            .filter(|r| filter(r))
            .map(|r| (r[x].as_f64().unwrap_or(0.0), r[y].as_f64().unwrap_or(0.0) * scale))
            .collect(),
    }
}

pub fn write_all(dir: &Path, bytes_rows: &[Value], count_rows: &[Value]) -> std::io::Result<()> {
    let with = |b: bool| move |r: &Value| r["backup"].as_bool() == Some(b);
    let by_bytes = vec![
        series(bytes_rows, with(false), "bytes", "pause_ns", 1e-6, "pause"),
        series(bytes_rows, with(false), "bytes", "resume_ns", 1e-6, "resume"),
        series(bytes_rows, with(true), "bytes", "pause_ns", 1e-6, "pause + backup"),
        series(bytes_rows, with(true), "bytes", "resume_ns", 1e-6, "resume + restore"),
    ];
    std::fs::write(dir.join("time_vs_bytes.svg"), svg("Pause/resume time vs bytes", "bytes", "ms", &by_bytes))?;
    let all = |_: &Value| true;
    let by_count = vec![
        series(count_rows, all, "allocations", "pause_ns", 1e-6, "pause"),
        series(count_rows, all, "allocations", "resume_ns", 1e-6, "resume"),
    ];
    std::fs::write(
        dir.join("time_vs_count.svg"),
        svg("Pause/resume time vs allocations", "allocations", "ms", &by_count),
    )?;
    let throughput = vec![
        series(bytes_rows, with(true), "bytes", "pause_bytes_per_s", 1e-9, "pause backup"),
        series(bytes_rows, with(true), "bytes", "raw_d2h_bytes_per_s", 1e-9, "raw D2H copy"),
        series(bytes_rows, with(true), "bytes", "resume_bytes_per_s", 1e-9, "resume restore"),
        series(bytes_rows, with(true), "bytes", "raw_h2d_bytes_per_s", 1e-9, "raw H2D copy"),
    ];
    std::fs::write(
        dir.join("throughput_vs_limit.svg"),
        svg("Backup throughput vs raw pinned copy", "bytes", "GB/s", &throughput),
    )
}
