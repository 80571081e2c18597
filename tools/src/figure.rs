//! Figures of the experiments: line series in one or more panels, written as a Markdown table,
//! a JSON file (the settings, the command and every measured point) and a plot (SVG and PNG).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

/// One line of a panel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Series {
    pub label: String,
    /// (x, y) in x order; a missing x is a gap in the table.
    pub points: Vec<(f64, f64)>,
}

/// One chart of a figure, with its own y axis.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Panel {
    pub title: String,
    pub y_desc: String,
    pub series: Vec<Series>,
}

/// A figure: panels side by side over one x axis.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    /// The sentence above the tables: what is measured, and under which settings.
    pub caption: String,
    pub x_desc: String,
    pub log_x: bool,
    pub log_y: bool,
    /// Decimals of the table's values.
    pub decimals: usize,
    pub panels: Vec<Panel>,
}

impl Figure {
    /// Every x of every series, sorted, deduplicated.
    fn xs(&self) -> Vec<f64> {
        let mut xs: Vec<f64> = self.panels.iter().flat_map(|p| &p.series).flat_map(|s| s.points.iter().map(|q| q.0)).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs
    }

    /// The Markdown tables: one per panel, a row per series, a column per x.
    pub fn markdown(&self) -> String {
        let xs = self.xs();
        let mut md = format!("{}\n", self.caption);
        for p in &self.panels {
            md.push_str(&format!("\n**{}** ({}; columns: {})\n\n|  |", p.title, p.y_desc, self.x_desc));
            for x in &xs {
                md.push_str(&format!(" {} |", fmt_x(*x)));
            }
            md.push_str("\n|---|");
            md.push_str(&"---|".repeat(xs.len()));
            md.push('\n');
            for s in &p.series {
                md.push_str(&format!("| {} |", s.label));
                for x in &xs {
                    match s.points.iter().find(|q| q.0 == *x) {
                        Some(q) => md.push_str(&format!(" {:.*} |", self.decimals, q.1)),
                        None => md.push_str(" - |"),
                    }
                }
                md.push('\n');
            }
        }
        md
    }

    /// Writes `<dir>/<name>.md`, `.json` (with `settings` and `rows`), `.svg` and `.png`.
    pub fn write<S: Serialize, R: Serialize>(&self, dir: &Path, name: &str, settings: &S, rows: &R) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let md_path = dir.join(format!("{name}.md"));
        std::fs::write(&md_path, self.markdown())?;
        let json_path = dir.join(format!("{name}.json"));
        let json =
            serde_json::json!({"command": command_line(), "measured": measured(), "settings": settings, "rows": rows, "figure": self});
        std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)?;
        let [svg, png] = self.plot(dir, name)?;
        Ok(vec![md_path, json_path, svg, png])
    }

    /// Draws `<dir>/<name>.svg` and `.png`.
    pub fn plot(&self, dir: &Path, name: &str) -> Result<[PathBuf; 2]> {
        let svg = dir.join(format!("{name}.svg"));
        let png = dir.join(format!("{name}.png"));
        ensure_font()?;
        let w = 420 * u32::try_from(self.panels.len().max(1)).unwrap_or(1);
        self.chart(SVGBackend::new(&svg, (w, 360)).into_drawing_area())?;
        self.chart(BitMapBackend::new(&png, (w, 360)).into_drawing_area())?;
        Ok([svg, png])
    }

    fn chart<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let e = |x: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plotting: {x:?}");
        root.fill(&WHITE).map_err(e)?;
        let xs = self.xs();
        let (x0, x1) = match (xs.first(), xs.last()) {
            (Some(&a), Some(&b)) if self.log_x => (a.max(1e-9) / 1.3, b.max(1e-9) * 1.3),
            (Some(&a), Some(&b)) => (a.min(0.0), b + (b - a.min(0.0)).max(1.0) * 0.05),
            _ => (0.0, 1.0),
        };
        let panels = root.split_evenly((1, self.panels.len().max(1)));
        for (area, p) in panels.iter().zip(&self.panels) {
            let ys: Vec<f64> = p.series.iter().flat_map(|s| s.points.iter().map(|q| q.1)).filter(|y| y.is_finite()).collect();
            let ymax = ys.iter().copied().fold(0.0, f64::max);
            let mut b = ChartBuilder::on(area);
            b.caption(&p.title, ("sans-serif", 17)).margin(8).x_label_area_size(32).y_label_area_size(58);
            if self.log_y {
                let top = ymax.max(1e-3) * 2.0;
                let bottom = ys.iter().copied().filter(|&v| v > 0.0).fold(top, f64::min).max(1e-3) / 2.0;
                if self.log_x {
                    let mut ch = b.build_cartesian_2d((x0..x1).log_scale(), (bottom..top).log_scale()).map_err(e)?;
                    ch.configure_mesh()
                        .x_desc(&self.x_desc)
                        .y_desc(&p.y_desc)
                        .x_label_formatter(&fmt_tick)
                        .y_label_formatter(&fmt_tick)
                        .draw()
                        .map_err(e)?;
                    draw_series(&mut ch, p, bottom).map_err(e)?;
                } else {
                    let mut ch = b.build_cartesian_2d(x0..x1, (bottom..top).log_scale()).map_err(e)?;
                    ch.configure_mesh()
                        .x_desc(&self.x_desc)
                        .y_desc(&p.y_desc)
                        .x_label_formatter(&fmt_tick)
                        .y_label_formatter(&fmt_tick)
                        .draw()
                        .map_err(e)?;
                    draw_series(&mut ch, p, bottom).map_err(e)?;
                }
            } else {
                let top = ymax.max(1e-9) * 1.15;
                if self.log_x {
                    let mut ch = b.build_cartesian_2d((x0..x1).log_scale(), 0.0..top).map_err(e)?;
                    ch.configure_mesh()
                        .x_desc(&self.x_desc)
                        .y_desc(&p.y_desc)
                        .x_label_formatter(&fmt_tick)
                        .y_label_formatter(&fmt_tick)
                        .draw()
                        .map_err(e)?;
                    draw_series(&mut ch, p, f64::NEG_INFINITY).map_err(e)?;
                } else {
                    let mut ch = b.build_cartesian_2d(x0..x1, 0.0..top).map_err(e)?;
                    ch.configure_mesh()
                        .x_desc(&self.x_desc)
                        .y_desc(&p.y_desc)
                        .x_label_formatter(&fmt_tick)
                        .y_label_formatter(&fmt_tick)
                        .draw()
                        .map_err(e)?;
                    draw_series(&mut ch, p, f64::NEG_INFINITY).map_err(e)?;
                }
            }
        }
        root.present().map_err(e)?;
        Ok(())
    }
}

/// An axis label: integers without decimals, small values with what they need.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn fmt_tick(v: &f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}").trim_end_matches('0').to_string()
    }
}

/// An x value as the table shows it: integers without decimals.
fn fmt_x(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        format!("{x}")
    }
}

/// Draws a panel's lines with markers and a legend; values under `floor` (zeros on a log
/// axis) are drawn at the floor.
fn draw_series<'a, DB, X, Y>(
    ch: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    p: &Panel,
    floor: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    for (k, s) in p.series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = s.points.iter().filter(|q| q.1.is_finite()).map(|&(x, y)| (x, y.max(floor))).collect();
        ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        ch.draw_series(pts.into_iter().map(|q| Circle::new(q, 3, c.filled())))?;
    }
    // The legend goes in the upper corner the lines leave free: left when they rise.
    let rising = p.series.iter().filter(|s| s.points.len() > 1).filter(|s| s.points[s.points.len() - 1].1 > s.points[0].1).count() * 2
        > p.series.len();
    let pos = if rising { SeriesLabelPosition::UpperLeft } else { SeriesLabelPosition::UpperRight };
    ch.configure_series_labels().position(pos).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    Ok(())
}

/// The command that made a figure, for the report (so anyone can run it again).
/// Where and when a figure was measured, for its JSON: the report prints it under the figure,
/// so a page regenerated later does not pass old figures off as the current commit's.
pub fn measured() -> String {
    format!("{}, {}", crate::provenance::machine(), crate::provenance::today())
}

pub fn command_line() -> String {
    let mut args = std::env::args();
    let prog = args.next().map(|p| Path::new(&p).file_name().map_or(p.clone(), |f| f.to_string_lossy().into_owned()));
    prog.into_iter().chain(args).map(|a| if a.contains(' ') { format!("'{a}'") } else { a }).collect::<Vec<_>>().join(" ")
}

/// The plots' font: DejaVu Sans (Debian's fonts-dejavu-core, which `make` installs).
pub fn ensure_font() -> Result<()> {
    static DONE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let path = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .ok_or("no DejaVuSans.ttf: install fonts-dejavu-core (make does)")?;
        let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| format!("{path} is not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

pub const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
