//! Every plot relax-colocate writes (the run's memory timeline and reward curve, the benchmark's
//! sweeps), drawn with plotters into SVG. One place decides units and ticks: sizes in
//! B/KiB/MiB/GiB and times in µs/ms/s, ticks on round values of the unit shown (never 78.8 MiB or
//! step 8.2), and powers of two or ten on log axes.

use plotters::coord::ranged1d::Ranged;
use plotters::prelude::*;
pub use plotters::style::RGBColor;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// What an axis measures, which picks its unit and tick labels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Quantity {
    /// Bytes (binary units).
    Bytes,
    /// Seconds (shown in µs, ms or s).
    Seconds,
    /// Bytes per second (decimal GB/s, as bus speeds are quoted).
    Rate,
    /// Whole numbers: steps, allocations.
    Count,
    /// Anything else, as is.
    Plain,
}

#[derive(Debug, Clone)]
pub struct Axis {
    pub label: String,
    pub quantity: Quantity,
    pub log: bool,
}

impl Axis {
    pub fn linear(label: &str, quantity: Quantity) -> Axis {
        Axis { label: label.into(), quantity, log: false }
    }
    pub fn log(label: &str, quantity: Quantity) -> Axis {
        Axis { label: label.into(), quantity, log: true }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    /// Points joined by straight lines, each marked.
    Marked,
    /// Points joined by straight lines.
    Line,
    /// A value that holds until the next sample (memory between phases).
    Steps,
    /// A horizontal reference (the device's capacity), dashed.
    Dashed,
}

#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub shape: Shape,
    pub color: RGBColor,
    pub width: u32,
}

/// A shaded span of x under the plot (a phase of the cycle), in a strip below the zero line so
/// that it never hides the data.
#[derive(Debug, Clone)]
pub struct Span {
    pub x0: f64,
    pub x1: f64,
    pub color: RGBColor,
    /// Written in its box where it fits (a chart of spans alone, `draw_spans`).
    pub label: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub width: u32,
    pub height: u32,
    pub x: Option<Axis>,
    pub y: Option<Axis>,
    /// Drawn stacked, first at the bottom, as step-shaped filled areas.
    pub stacked: Vec<Series>,
    pub series: Vec<Series>,
    pub spans: Vec<Span>,
    /// Legend entries for the span colours.
    pub span_legend: Vec<(String, RGBColor)>,
    /// Fixed y range (in the quantity's base unit), else from the data.
    pub y_range: Option<(f64, f64)>,
    /// A hatched box over the lines (a request that did not fit), part of the y range.
    pub bar: Option<Bar>,
}

/// A hatched box from `y0` to `y1` just left of `x`, labelled at its top: what a run asked for
/// when it failed, on top of what was in use.
#[derive(Debug, Clone)]
pub struct Bar {
    pub x: f64,
    pub y0: f64,
    pub y1: f64,
    pub label: String,
    pub color: RGBColor,
}

pub const PALETTE: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A linear axis's display unit: (divisor, name) so that the largest value reads 1 to 1023.
fn linear_unit(q: Quantity, max: f64) -> (f64, &'static str) {
    match q {
        Quantity::Bytes => {
            let units = [(1u64 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
            units.iter().find(|(u, _)| max >= *u as f64).map_or((1.0, "B"), |&(u, n)| (u as f64, n))
        }
        Quantity::Seconds if max < 1e-3 => (1e-6, "µs"),
        Quantity::Seconds if max < 1.0 => (1e-3, "ms"),
        Quantity::Seconds => (1.0, "s"),
        Quantity::Rate => (1e9, "GB/s"),
        Quantity::Count | Quantity::Plain => (1.0, ""),
    }
}

/// Round ticks covering [lo, hi]: 1, 2, 2.5 or 5 times a power of ten apart, about `n` of them.
pub fn nice_ticks(lo: f64, hi: f64, n: usize, whole: bool) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let mut step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    if whole {
        step = step.max(1.0).round();
    }
    let first = (lo / step).ceil() * step;
    let mut ticks = Vec::new();
    let mut k = 0.0;
    while first + k * step <= hi + step * 1e-9 {
        // Multiplying rather than adding keeps 0.1-steps from drifting to 0.30000000000000004.
        let t = first + k * step;
        // 3 x 0.2 is 0.6000000000000001: round to the step's own decimals.
        let decimals = (-step.log10().floor()).max(0.0) as i32 + 1;
        let p = 10f64.powi(decimals);
        let t = (t * p).round() / p;
        ticks.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        k += 1.0;
    }
    ticks
}

/// A number as a tick label: no trailing zeros, no exponent.
pub fn tick_label(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        return format!("{}", v as i64);
    }
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Ticks of a log axis over [lo, hi] (both > 0): powers of two for sizes (labelled 4 KiB, 1 MiB),
/// powers of ten otherwise (labelled 1 ms, 10 ms for times), at most about eight.
fn log_ticks(q: Quantity, lo: f64, hi: f64) -> Vec<(f64, String)> {
    let base: f64 = if q == Quantity::Bytes { 2.0 } else { 10.0 };
    let (e0, e1) = (lo.log(base).floor() as i32, hi.log(base).ceil() as i32);
    let every = ((e1 - e0) as usize).div_ceil(8).max(1) as i32;
    // Binary sizes read best at whole units: step the exponent in multiples that keep 2^e on
    // 1, 4, 16, 64, 256 or 1, 2, 4...
    let every = if q == Quantity::Bytes && every > 1 { (every as u32).next_power_of_two() as i32 } else { every };
    let mut out = Vec::new();
    let mut e = e0 - e0.rem_euclid(every);
    while e <= e1 {
        let v = base.powi(e);
        out.push((v, log_label(q, v)));
        e += every;
    }
    out
}

fn log_label(q: Quantity, v: f64) -> String {
    match q {
        Quantity::Bytes => {
            let (d, u) = linear_unit(q, v);
            format!("{} {u}", tick_label(v / d))
        }
        Quantity::Seconds => {
            let (d, u) = linear_unit(q, v * 1.0001);
            format!("{} {u}", tick_label(v / d))
        }
        Quantity::Rate => format!("{} GB/s", tick_label(v / 1e9)),
        _ => tick_label(v),
    }
}

fn axis_desc(axis: &Axis, unit: &str) -> String {
    if unit.is_empty() || axis.log { axis.label.clone() } else { format!("{} ({unit})", axis.label) }
}

struct Scaled {
    divisor: f64,
    unit: &'static str,
    lo: f64,
    hi: f64,
    ticks: Vec<(f64, String)>,
}

fn scale(axis: &Axis, lo: f64, hi: f64, horizontal: bool) -> Scaled {
    if axis.log {
        let (lo, hi) = (lo.max(f64::MIN_POSITIVE), hi.max(lo * 2.0));
        let ticks = log_ticks(axis.quantity, lo, hi);
        let lo = ticks.first().map_or(lo, |t| t.0.min(lo));
        let hi = ticks.last().map_or(hi, |t| t.0.max(hi));
        return Scaled { divisor: 1.0, unit: "", lo, hi, ticks };
    }
    let (divisor, unit) = linear_unit(axis.quantity, lo.abs().max(hi.abs()));
    let (lo, hi) = (lo / divisor, hi / divisor);
    let hi = if hi - lo < 1e-12 { lo + 1.0 } else { hi };
    let whole = axis.quantity == Quantity::Count;
    let ticks: Vec<(f64, String)> =
        nice_ticks(lo, hi, if horizontal { 8 } else { 6 }, whole).into_iter().map(|t| (t, tick_label(t))).collect();
    Scaled { divisor, unit, lo, hi, ticks }
}

fn bounds(points: impl Iterator<Item = (f64, f64)>) -> Option<((f64, f64), (f64, f64))> {
    let mut b: Option<((f64, f64), (f64, f64))> = None;
    for (x, y) in points.filter(|(x, y)| x.is_finite() && y.is_finite()) {
        b = Some(match b {
            None => ((x, x), (y, y)),
            Some(((x0, x1), (y0, y1))) => ((x0.min(x), x1.max(x)), (y0.min(y), y1.max(y))),
        });
    }
    b
}

/// The chart as an SVG document.
pub fn svg(chart: &Chart) -> String {
    let mut out = String::new();
    let size = (chart.width.max(320), chart.height.max(240));
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        // Drawing into a string cannot fail but for our own misuse; a broken plot must never
        // fail the run that produced the data.
        if let Err(e) = draw(&root, chart) {
            let _ = root.fill(&WHITE);
            let _ = root.draw_text(&format!("cannot draw this plot: {e}"), &("sans-serif", 14).into(), (20, 20));
        }
        let _ = root.present();
    }
    out
}

/// Charts one above the other in one SVG, each with its own axes, title and legend (a run's
/// devices over the same time).
pub fn svg_panels(charts: &[Chart]) -> String {
    if let [one] = charts {
        return svg(one);
    }
    let width = charts.iter().map(|c| c.width.max(320)).max().unwrap_or(320);
    let height: u32 = charts.iter().map(|c| c.height.max(240)).sum();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (width, height.max(240))).into_drawing_area();
        let mut rest = root.clone();
        for chart in charts {
            let (panel, below) = rest.split_vertically(chart.height.max(240));
            if let Err(e) = draw(&panel, chart) {
                let _ = panel.fill(&WHITE);
                let _ = panel.draw_text(&format!("cannot draw this plot: {e}"), &("sans-serif", 14).into(), (20, 20));
            }
            rest = below;
        }
        let _ = root.present();
    }
    out
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

fn draw(root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, chart: &Chart) -> DrawResult {
    root.fill(&WHITE)?;
    if chart.series.is_empty() && chart.stacked.is_empty() && !chart.spans.is_empty() {
        return draw_spans(root, chart);
    }
    let x_axis = chart.x.clone().unwrap_or_else(|| Axis::linear("", Quantity::Plain));
    let y_axis = chart.y.clone().unwrap_or_else(|| Axis::linear("", Quantity::Plain));
    let keep = |p: &&(f64, f64)| (!x_axis.log || p.0 > 0.0) && (!y_axis.log || p.1 > 0.0);
    let mut stack_top: Vec<(f64, f64)> = Vec::new();
    for s in &chart.stacked {
        stack_top.extend(s.points.iter().copied());
    }
    let stacked = stack(&chart.stacked);
    let all = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter())
        .chain(stacked.iter().flat_map(|s| s.points.iter()))
        .filter(keep)
        .copied()
        .chain(chart.bar.iter().flat_map(|b| [(b.x, b.y0), (b.x, b.y1)]));
    let Some(((x0, x1), (mut y0, mut y1))) = bounds(all) else {
        root.draw_text(&format!("{}: no data", chart.title), &("sans-serif", 15).into(), (20, 20))?;
        return Ok(());
    };
    if let Some((lo, hi)) = chart.y_range {
        (y0, y1) = (lo, hi);
    } else if !y_axis.log {
        y0 = y0.min(0.0);
        y1 *= 1.05;
    }
    let xs = scale(&x_axis, x0, x1, true);
    let mut ys = scale(&y_axis, y0, y1, false);
    // The phase strip lives below zero, under the data.
    let strip = if chart.spans.is_empty() || y_axis.log {
        None
    } else {
        let h = (ys.hi - ys.lo) * 0.05;
        let strip = (ys.lo - h * 1.2, ys.lo - h * 0.2);
        ys.lo -= h * 1.3;
        Some(strip)
    };
    let legend_w = legend_width(chart);
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(&chart.title, ("sans-serif", 17))
        .margin(12)
        .margin_right(legend_w)
        .x_label_area_size(42)
        .y_label_area_size(70);
    let ctx = builder.build_cartesian_2d(Ticked::of(&xs, x_axis.log), Ticked::of(&ys, y_axis.log))?;
    finish(ctx, chart, &x_axis, &y_axis, &xs, &ys, strip, &stacked)?;
    legend(root, chart)
}

/// Pixels a label of `chars` characters needs in a span's box to be drawn there: plotters writes
/// the 12-point font at about 5.5 pixels a character (an average; a margin each side).
pub fn label_room(chars: usize) -> f64 {
    chars as f64 * 5.5 + 8.0
}

/// A chart of spans alone (the phases of a few steps): the boxes fill its height over a time
/// axis, each labelled where its label fits (`label_room`), the others left to the legend.
fn draw_spans(root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, chart: &Chart) -> DrawResult {
    let x_axis = chart.x.clone().unwrap_or_else(|| Axis::linear("", Quantity::Plain));
    let x0 = chart.spans.iter().map(|s| s.x0).fold(f64::INFINITY, f64::min);
    let x1 = chart.spans.iter().map(|s| s.x1).fold(f64::NEG_INFINITY, f64::max);
    let xs = scale(&x_axis, x0, x1, true);
    let ys = Scaled { divisor: 1.0, unit: "", lo: 0.0, hi: 1.0, ticks: Vec::new() };
    let mut ctx = ChartBuilder::on(root)
        .caption(&chart.title, ("sans-serif", 17))
        .margin(12)
        .margin_right(legend_width(chart))
        .x_label_area_size(42)
        .y_label_area_size(70)
        .build_cartesian_2d(Ticked::of(&xs, false), Ticked::of(&ys, false))?;
    let x_fmt = |v: &f64| xs.ticks.iter().find(|t| (t.0 - v).abs() <= t.0.abs().max(1e-12) * 1e-6).map(|t| t.1.clone());
    ctx.configure_mesh()
        .x_desc(axis_desc(&x_axis, xs.unit))
        .x_label_formatter(&|v| x_fmt(v).unwrap_or_default())
        .disable_y_mesh()
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 13))
        .draw()?;
    let d = xs.divisor;
    let boxes =
        chart.spans.iter().map(|s| Rectangle::new([(s.x0 / d, 0.1), (s.x1.max(s.x0) / d, 0.9)], s.color.filled()));
    ctx.draw_series(boxes)?;
    let font = ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Center));
    for s in &chart.spans {
        let Some(label) = &s.label else { continue };
        let (left, right) = (ctx.backend_coord(&(s.x0 / d, 0.5)).0, ctx.backend_coord(&(s.x1 / d, 0.5)).0);
        if f64::from(right - left) >= label_room(label.chars().count()) {
            ctx.draw_series([Text::new(label.clone(), ((s.x0 + s.x1) / 2.0 / d, 0.5), font.clone())])?;
        }
    }
    legend(root, chart)
}

/// A linear or logarithmic axis whose ticks are exactly ours (plotters' own picks fall on values
/// like 78.8 for data in MiB).
struct Ticked {
    lo: f64,
    hi: f64,
    log: bool,
    ticks: Vec<f64>,
}

impl Ticked {
    fn of(s: &Scaled, log: bool) -> Ticked {
        Ticked {
            lo: s.lo,
            hi: s.hi,
            log,
            ticks: s.ticks.iter().map(|t| t.0).filter(|t| *t >= s.lo && *t <= s.hi).collect(),
        }
    }
    fn position(&self, v: f64) -> f64 {
        if self.log {
            let v = v.max(self.lo);
            (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }
}

impl Ranged for Ticked {
    type FormatOption = plotters::coord::ranged1d::DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let p = self.position(*value);
        (f64::from(limit.0) + p * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: plotters::coord::ranged1d::KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Light (minor) lines are not drawn; the bold ones are our ticks.
        if hint.max_num_points() == 0 { Vec::new() } else { self.ticks.clone() }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

/// The stacked series as cumulative step-shaped outlines, bottom first: each sample's value is
/// the sum of its own and every series below it at that time.
fn stack(series: &[Series]) -> Vec<Series> {
    let mut below: Vec<(f64, f64)> = Vec::new();
    let mut out = Vec::new();
    for s in series {
        let top: Vec<(f64, f64)> =
            s.points.iter().enumerate().map(|(i, &(x, y))| (x, y + below.get(i).map_or(0.0, |b| b.1))).collect();
        below = top.clone();
        out.push(Series { points: top, ..s.clone() });
    }
    out
}

/// An opaque lighter shade: stacked layers painted over each other must not mix their colours.
fn light(c: RGBColor) -> RGBColor {
    let mix = |v: u8| (f64::from(v) * 0.55 + 255.0 * 0.45).round() as u8;
    RGBColor(mix(c.0), mix(c.1), mix(c.2))
}

fn steps(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(points.len() * 2);
    for (i, &(x, y)) in points.iter().enumerate() {
        if i > 0 {
            out.push((x, points[i - 1].1));
        }
        out.push((x, y));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn finish<'a>(
    mut ctx: ChartContext<'a, SVGBackend<'a>, Cartesian2d<Ticked, Ticked>>,
    chart: &Chart,
    x_axis: &Axis,
    y_axis: &Axis,
    xs: &Scaled,
    ys: &Scaled,
    strip: Option<(f64, f64)>,
    stacked: &[Series],
) -> DrawResult {
    let label_of = |ticks: &[(f64, String)], v: f64| {
        ticks.iter().find(|t| (t.0 - v).abs() <= t.0.abs().max(1e-12) * 1e-6).map(|t| t.1.clone()).unwrap_or_default()
    };
    let x_fmt = |v: &f64| label_of(&xs.ticks, *v);
    // Ticks under zero (the phase strip's room) get no label.
    let y_fmt = |v: &f64| if *v < 0.0 && strip.is_some() { String::new() } else { label_of(&ys.ticks, *v) };
    ctx.configure_mesh()
        .x_desc(axis_desc(x_axis, xs.unit))
        .y_desc(axis_desc(y_axis, ys.unit))
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(225, 225, 225))
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 13))
        .draw()?;
    let (xd, yd) = (xs.divisor, ys.divisor);
    let scaled = |pts: &[(f64, f64)]| -> Vec<(f64, f64)> {
        pts.iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!x_axis.log || *x > 0.0) && (!y_axis.log || *y > 0.0))
            .map(|(x, y)| (x / xd, y / yd))
            .collect()
    };
    if let Some((lo, hi)) = strip {
        ctx.draw_series(
            chart
                .spans
                .iter()
                .map(|s| Rectangle::new([(s.x0 / xd, lo), ((s.x1 / xd).max(s.x0 / xd), hi)], s.color.filled())),
        )?;
    }
    // Top of the stack first, each lower layer painted over it, so every band keeps its colour.
    for s in stacked.iter().rev() {
        let pts = steps(&scaled(&s.points));
        let c = s.color;
        ctx.draw_series(AreaSeries::new(pts, 0.0, light(c).filled()).border_style(c.stroke_width(1)))?;
    }
    let overlaps = coinciding(&chart.series);
    for (s, over) in chart.series.iter().zip(&overlaps) {
        let pts = scaled(&s.points);
        let style = s.color.stroke_width(s.width.max(1));
        let pts = if s.shape == Shape::Steps { steps(&pts) } else { pts };
        if let Some(over) = over {
            // Dashed over the line it hides, so that the earlier one shows in the gaps.
            let (on, off) = dash(over.nth);
            ctx.draw_series(DashedLineSeries::new(pts, on, off, s.color.stroke_width(s.width.max(2))))?;
            continue;
        }
        match s.shape {
            Shape::Steps | Shape::Line => ctx.draw_series(LineSeries::new(pts, style))?,
            Shape::Marked => ctx.draw_series(LineSeries::new(pts, style).point_size(3))?,
            Shape::Dashed => ctx.draw_series(DashedLineSeries::new(pts, 8, 5, style))?,
        };
    }
    if let Some(bar) = &chart.bar {
        draw_bar(&mut ctx, bar, (xd, yd), (xs.hi - xs.lo, ys.hi - ys.lo))?;
    }
    Ok(())
}

/// The bar, 1.5% of the x range wide and at least 1.5% of the y range tall (a request of 2 MiB
/// on a device of 80 GiB must still show; its label says its size), hatched so that it reads as
/// asked for rather than held, its label left of its top (it stands at the end of the run, the
/// chart's right edge).
fn draw_bar<'a>(
    ctx: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<Ticked, Ticked>>,
    bar: &Bar,
    (xd, yd): (f64, f64),
    (x_span, y_span): (f64, f64),
) -> DrawResult {
    let (x1, y0) = (bar.x / xd, bar.y0 / yd);
    let (x0, y1) = (x1 - 0.015 * x_span, (bar.y1 / yd).max(y0 + 0.015 * y_span));
    let c = bar.color;
    ctx.draw_series([Rectangle::new([(x0, y0), (x1, y1)], c.mix(0.15).filled())])?;
    // Lines u + v = k / 4 of the box's unit square, clipped to it.
    let at = |u: f64, v: f64| (x0 + u * (x1 - x0), y0 + v * (y1 - y0));
    let hatch = (1..8).map(|k| {
        let k = f64::from(k) / 4.0;
        let (a, b) = if k <= 1.0 { (at(0.0, k), at(k, 0.0)) } else { (at(k - 1.0, 1.0), at(1.0, k - 1.0)) };
        PathElement::new(vec![a, b], c.stroke_width(1))
    });
    ctx.draw_series(hatch)?;
    ctx.draw_series([Rectangle::new([(x0, y0), (x1, y1)], c.stroke_width(2))])?;
    let font = ("sans-serif", 13).into_font().color(&c).pos(Pos::new(HPos::Right, VPos::Bottom));
    ctx.draw_series([EmptyElement::at((x0, y1)) + Text::new(bar.label.clone(), (-4, -3), font)])?;
    Ok(())
}

/// A series whose line coincides with an earlier one's: which (its index) and how many hide
/// the same line before it (1 for the first), which picks its dashes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlap {
    pub of: usize,
    pub nth: u32,
}

/// For each series, the earlier series its line would hide (identical replicas, rollout-0 and
/// rollout-1, draw the same line): the same x's and every y within 0.2% of the larger series'
/// highest, less than a pixel on any chart we draw. Dashed references (the capacity) are never
/// compared: they are not measurements.
pub fn coinciding(series: &[Series]) -> Vec<Option<Overlap>> {
    let mut out: Vec<Option<Overlap>> = vec![None; series.len()];
    for i in 0..series.len() {
        if series[i].shape == Shape::Dashed {
            continue;
        }
        let Some(j) = (0..i).find(|&j| out[j].is_none() && same_line(&series[j], &series[i])) else { continue };
        let nth = out[..i].iter().flatten().filter(|o| o.of == j).count() as u32 + 1;
        out[i] = Some(Overlap { of: j, nth });
    }
    out
}

fn same_line(a: &Series, b: &Series) -> bool {
    if a.shape == Shape::Dashed || a.points.len() != b.points.len() || a.points.is_empty() {
        return false;
    }
    let top = a.points.iter().chain(&b.points).map(|p| p.1.abs()).fold(0.0, f64::max);
    let (dx, dy) = (1e-9 * a.points.iter().map(|p| p.0.abs()).fold(1.0, f64::max), 2e-3 * top);
    a.points.iter().zip(&b.points).all(|(p, q)| (p.0 - q.0).abs() <= dx && (p.1 - q.1).abs() <= dy)
}

/// The dashes (on, off in pixels) of the `nth` series over the same line: each shorter than
/// the one before it over the same 20-pixel period, so that every one of them keeps a visible
/// part of each period.
fn dash(nth: u32) -> (u32, u32) {
    let on = (12 / nth.max(1)).max(2);
    (on, 20 - on)
}

/// The series' legend entries: a series hiding an earlier one's line says so.
fn legend_names(chart: &Chart) -> Vec<String> {
    let overlaps = coinciding(&chart.series);
    chart
        .series
        .iter()
        .zip(overlaps)
        .map(|(s, o)| match o {
            Some(o) => format!("{} (overlaps {})", s.name, chart.series[o.of].name),
            None => s.name.clone(),
        })
        .collect()
}

/// Room right of the plot for the legend: 190 pixels, more for long entries (plotters writes
/// the legend's 12-point font at about 5 pixels a character).
fn legend_width(chart: &Chart) -> u32 {
    let names = legend_names(chart).into_iter().chain(chart.stacked.iter().map(|s| s.name.clone()));
    let longest = names.chain(chart.span_legend.iter().map(|l| l.0.clone())).map(|n| n.chars().count()).max();
    match longest {
        None => 20,
        Some(n) => 190u32.max(n as u32 * 5 + 40),
    }
}

/// The legend, right of the plot (plotters' own is clipped to the plotting area, over the data):
/// lines for series, filled boxes for stacked areas and phase colours.
fn legend(root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>, chart: &Chart) -> DrawResult {
    let x = chart.width.max(320) as i32 - legend_width(chart) as i32 + 10;
    let mut y = 48;
    let font = ("sans-serif", 12).into_font().color(&BLACK);
    for (s, name) in chart.series.iter().zip(legend_names(chart)) {
        let (x0, x1) = (x, x + 18);
        let overlaps = name != s.name;
        match s.shape {
            Shape::Dashed => {
                root.draw(&PathElement::new(vec![(x0, y), (x0 + 7, y)], s.color.stroke_width(2)))?;
                root.draw(&PathElement::new(vec![(x0 + 11, y), (x1, y)], s.color.stroke_width(2)))?;
            }
            // The dashes it is drawn with on the chart.
            _ if overlaps => {
                root.draw(&PathElement::new(vec![(x0, y), (x0 + 5, y)], s.color.stroke_width(3)))?;
                root.draw(&PathElement::new(vec![(x0 + 12, y), (x1, y)], s.color.stroke_width(3)))?;
            }
            _ => root.draw(&PathElement::new(vec![(x0, y), (x1, y)], s.color.stroke_width(3)))?,
        }
        root.draw_text(&name, &font, (x + 24, y - 6))?;
        y += 18;
    }
    let boxes =
        chart.stacked.iter().rev().map(|s| (s.name.clone(), light(s.color))).chain(chart.span_legend.iter().cloned());
    for (name, c) in boxes {
        root.draw(&Rectangle::new([(x, y - 6), (x + 18, y + 6)], c.filled()))?;
        root.draw_text(&name, &font, (x + 24, y - 6))?;
        y += 18;
    }
    Ok(())
}

/// Reading back the SVG plotters writes, for tests that check what was drawn: its elements
/// with their attributes, and the text of its `<text>` elements.
#[cfg(test)]
pub(crate) mod read_svg {
    use std::collections::BTreeMap;

    /// Every `<tag ...>` element's attributes, in document order.
    pub fn elements(svg: &str, tag: &str) -> Vec<BTreeMap<String, String>> {
        let open = format!("<{tag} ");
        svg.match_indices(&open).map(|(at, _)| attributes(&svg[at + open.len()..])).collect()
    }

    fn attributes(rest: &str) -> BTreeMap<String, String> {
        let end = rest.find('>').unwrap_or(rest.len());
        let mut out = BTreeMap::new();
        let mut s = &rest[..end];
        while let Some(eq) = s.find("=\"") {
            let name = s[..eq].trim().to_string();
            let value_end = s[eq + 2..].find('"').map_or(s.len(), |v| eq + 2 + v);
            out.insert(name, s[eq + 2..value_end].to_string());
            s = &s[(value_end + 1).min(s.len())..];
        }
        out
    }

    /// The text of every `<text>` element with its attributes.
    pub fn texts(svg: &str) -> Vec<(BTreeMap<String, String>, String)> {
        svg.match_indices("<text ")
            .map(|(at, _)| {
                let rest = &svg[at + 6..];
                let body = rest.find('>').map_or("", |b| &rest[b + 1..]);
                let body = &body[..body.find("</text>").unwrap_or(body.len())];
                (attributes(rest), body.trim().to_string())
            })
            .collect()
    }

    /// A polyline's points.
    pub fn points(e: &BTreeMap<String, String>) -> Vec<(f64, f64)> {
        let parse = |p: &str| {
            let (x, y) = p.split_once(',')?;
            Some((x.parse().ok()?, y.parse().ok()?))
        };
        e.get("points").map(|p| p.split_whitespace().filter_map(parse).collect()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::read_svg::{elements, points, texts};
    use super::*;

    #[test]
    fn ticks_fall_on_round_values() {
        assert_eq!(nice_ticks(0.0, 236.2, 6, false), vec![0.0, 50.0, 100.0, 150.0, 200.0]);
        assert_eq!(nice_ticks(1.0, 30.0, 6, true), vec![5.0, 10.0, 15.0, 20.0, 25.0, 30.0]);
        assert_eq!(nice_ticks(0.0, 1.0, 5, false), vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
        // Steps are whole numbers even over a short run.
        assert_eq!(nice_ticks(1.0, 3.0, 6, true), vec![1.0, 2.0, 3.0]);
        assert_eq!(tick_label(0.30000000000000004), "0.3");
        assert_eq!(tick_label(150.0), "150");
    }

    #[test]
    fn sizes_pick_a_unit_and_log_sizes_land_on_powers_of_two() {
        assert_eq!(linear_unit(Quantity::Bytes, 236.2 * 1048576.0), (1048576.0, "MiB"));
        assert_eq!(linear_unit(Quantity::Bytes, 3.0 * 1073741824.0).1, "GiB");
        assert_eq!(linear_unit(Quantity::Seconds, 0.25).1, "ms");
        let t = log_ticks(Quantity::Bytes, 4096.0, 1073741824.0);
        assert!(t.len() <= 10, "{t:?}");
        assert!(t.iter().all(|(v, _)| v.log2().fract() == 0.0), "{t:?}");
        assert!(t.iter().any(|(_, l)| l == "1 MiB"), "{t:?}");
        let t = log_ticks(Quantity::Seconds, 2e-5, 0.3);
        let labels: Vec<&str> = t.iter().map(|x| x.1.as_str()).collect();
        assert_eq!(labels, ["10 µs", "100 µs", "1 ms", "10 ms", "100 ms", "1 s"]);
    }

    #[test]
    fn a_chart_renders_its_ticks_legend_and_no_exponents() {
        let chart = Chart {
            title: "t".into(),
            width: 800,
            height: 400,
            x: Some(Axis::linear("time", Quantity::Seconds)),
            y: Some(Axis::linear("memory", Quantity::Bytes)),
            series: vec![Series {
                name: "device in use".into(),
                points: vec![(0.0, 0.0), (10.0, 236.2 * 1048576.0), (20.0, 80.0 * 1048576.0)],
                shape: Shape::Steps,
                color: color(0),
                width: 2,
            }],
            spans: vec![Span { x0: 0.0, x1: 5.0, color: RGBColor(200, 0, 0), label: None }],
            span_legend: vec![("generate".into(), RGBColor(200, 0, 0))],
            ..Chart::default()
        };
        let s = svg(&chart);
        assert!(s.starts_with("<svg") && s.contains("</svg>"), "{s}");
        assert!(s.contains("\n200\n") && s.contains("memory (MiB)") && s.contains("time (s)"), "{s}");
        assert!(s.contains("device in use") && s.contains("generate"), "{s}");
        assert!(!s.contains("e6") && !s.contains("78.8"), "{s}");
    }

    /// Two replicas with the same memory curve: the second is drawn dashed over the first, which
    /// shows in its gaps, and the legend says they overlap.
    #[test]
    fn a_series_that_coincides_with_another_is_dashed_over_it_and_said_to_overlap() {
        let curve: Vec<(f64, f64)> = (0..20).map(|i| (f64::from(i), f64::from(i % 5) * 1048576.0)).collect();
        let line = |name: &str, color| Series {
            name: name.into(),
            points: curve.clone(),
            shape: Shape::Steps,
            color,
            width: 2,
        };
        let (first, second) = (RGBColor(0, 0, 200), RGBColor(200, 0, 0));
        let chart = Chart {
            width: 800,
            height: 400,
            series: vec![line("rollout-0", first), line("rollout-1", second)],
            ..Chart::default()
        };
        assert_eq!(coinciding(&chart.series), [None, Some(Overlap { of: 0, nth: 1 })]);
        let s = svg(&chart);
        let stroked = |c: RGBColor| -> Vec<Vec<(f64, f64)>> {
            let hex = format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2);
            elements(&s, "polyline").iter().filter(|e| e["stroke"] == hex).map(points).collect()
        };
        let length = |lines: &[Vec<(f64, f64)>]| -> f64 {
            lines.iter().flat_map(|l| l.windows(2)).map(|w| (w[1].0 - w[0].0).abs() + (w[1].1 - w[0].1).abs()).sum()
        };
        // The first is one solid line; the second covers a part of it only, in many dashes.
        let (solid, dashes) = (stroked(first), stroked(second));
        let (solid_len, dashed_len) = (length(&solid), length(&dashes));
        assert!(solid.len() <= 2 && solid_len > 500.0, "{solid:?}");
        assert!(dashes.len() > 20, "{dashes:?}");
        assert!(dashed_len > 0.3 * solid_len && dashed_len < 0.8 * solid_len, "{dashed_len} of {solid_len}");
        let legend: Vec<String> = texts(&s).into_iter().map(|t| t.1).collect();
        assert!(legend.contains(&"rollout-0".to_string()), "{legend:?}");
        assert!(legend.contains(&"rollout-1 (overlaps rollout-0)".to_string()), "{legend:?}");
    }

    #[test]
    fn lines_apart_a_capacity_line_and_a_third_replica_are_told_apart() {
        let at = |y: f64| -> Vec<(f64, f64)> { (0..10).map(|i| (f64::from(i), y)).collect() };
        let line = |name: &str, points, shape| Series { name: name.into(), points, shape, color: color(0), width: 1 };
        let series = vec![
            line("a", at(100.0), Shape::Line),
            line("b", at(101.0), Shape::Line),
            line("capacity", at(100.0), Shape::Dashed),
            line("c", at(100.0), Shape::Line),
            line("d", at(100.0), Shape::Line),
        ];
        // b is 1% off a: a line of its own; the capacity is never an overlap.
        let got = coinciding(&series);
        assert_eq!(got, [None, None, None, Some(Overlap { of: 0, nth: 1 }), Some(Overlap { of: 0, nth: 2 })]);
        assert!(dash(1).0 > dash(2).0 && dash(2).0 >= 2);
    }

    /// A request that did not fit: a hatched box standing on what was in use, reaching over the
    /// capacity line, labelled with its size.
    #[test]
    fn a_failed_request_is_a_hatched_box_over_the_capacity_with_its_size() {
        const MIB: f64 = 1048576.0;
        let flat = |y: f64| -> Vec<(f64, f64)> { (0..=10).map(|i| (f64::from(i), y)).collect() };
        let gray = RGBColor(120, 120, 120);
        let chart = Chart {
            width: 800,
            height: 400,
            series: vec![
                Series {
                    name: "in use".into(),
                    points: flat(700.0 * MIB),
                    shape: Shape::Steps,
                    color: color(0),
                    width: 2,
                },
                Series {
                    name: "capacity".into(),
                    points: flat(900.0 * MIB),
                    shape: Shape::Dashed,
                    color: gray,
                    width: 1,
                },
            ],
            bar: Some(Bar {
                x: 10.0,
                y0: 700.0 * MIB,
                y1: 936.0 * MIB,
                label: "failed: +236.0 MiB (kv_cache)".into(),
                color: RGBColor(204, 0, 0),
            }),
            ..Chart::default()
        };
        let s = svg(&chart);
        let num = |e: &std::collections::BTreeMap<String, String>, k: &str| e[k].parse::<f64>().unwrap();
        let outline: Vec<_> =
            elements(&s, "rect").into_iter().filter(|e| e["stroke"] == "#CC0000" && e["fill"] == "none").collect();
        assert_eq!(outline.len(), 1, "{s}");
        let (top, bottom) = (num(&outline[0], "y"), num(&outline[0], "y") + num(&outline[0], "height"));
        let y_of = |stroke: &str| {
            elements(&s, "polyline")
                .iter()
                .filter(|e| e["stroke"] == stroke)
                .flat_map(points)
                .map(|p| p.1)
                .next()
                .unwrap()
        };
        // Pixels grow downwards: the box starts at the in-use line and ends above the capacity.
        let (used_y, capacity_y) = (y_of("#1F77B4"), y_of("#787878"));
        assert!((bottom - used_y).abs() <= 1.5, "{bottom} vs {used_y}");
        assert!(top < capacity_y - 10.0, "{top} vs {capacity_y}");
        let hatch = elements(&s, "polyline").into_iter().filter(|e| e["stroke"] == "#CC0000").count();
        assert!(hatch >= 5, "{hatch} hatch lines");
        assert!(texts(&s).iter().any(|t| t.1 == "failed: +236.0 MiB (kv_cache)"), "{s}");
    }
}
