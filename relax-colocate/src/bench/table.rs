//! How the bench reports: its Markdown tables, the units in them, and the judged targets.

use serde_json::Value;

/// A judged target: what, the figure, met or not.
pub(super) type Target = (&'static str, String, bool);

pub(super) fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or(f64::NAN)
}

pub(super) fn gbs(bytes_per_s: f64) -> String {
    format!("{:.2}", bytes_per_s / 1e9)
}

pub(super) fn human(bytes: f64) -> String {
    tms_proto::size::format_size(bytes.max(0.0) as u64)
}

/// A Markdown table (paste-able into docs/perf.md), the first column left-aligned and the
/// figures right-aligned.
pub(super) fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    use comfy_table::{CellAlignment, Table, presets};
    let mut t = Table::new();
    t.load_preset(presets::ASCII_MARKDOWN).set_header(header.iter().copied());
    for row in rows {
        t.add_row(row);
    }
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_cell_alignment(if i == 0 { CellAlignment::Left } else { CellAlignment::Right });
    }
    t.to_string()
}

pub(super) fn print_targets(targets: &[Target]) {
    println!("\nTargets (this run)");
    let lines = targets
        .iter()
        .map(|(t, m, ok)| vec![t.to_string(), m.clone(), (if *ok { "yes" } else { "NO" }).to_string()])
        .collect();
    println!("{}", table(&["target", "measured", "met"], lines));
}
