//! PNG plots of a run's metrics, drawn with `plotters` (its bitmap backend, text through
//! `ab_glyph` with DejaVu Sans embedded in the binary: no system font or fontconfig needed):
//! reward and accuracy per step with a moving average and the held-out evaluations, the loss, and
//! the step time split into rollout and update.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle, RGBColor};
use serde_json::Value;

use crate::error::{io, Result, TrainError};

const SIZE: (u32, u32) = (900, 500);
/// DejaVu Sans, printable ASCII only (crates/train/assets/README.md).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-ASCII.ttf");
const PALETTE: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A line.
    Line,
    /// A thin, light line: noisy per-step values under their moving average.
    Faint,
    /// Markers joined by a line: sparse values such as evaluations.
    Points,
}

/// A named series of (x, y) points.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub style: Style,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>, style: Style) -> Self {
        Self { name: name.into(), points, style }
    }
}

fn font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    if *REGISTERED.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(TrainError::Other("the embedded plot font could not be loaded".into()))
    }
}

fn plot_error(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Other(format!("{}: {e}", path.display()))
}

/// The range of the finite values, widened when it is a single value.
fn range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
    if lo > hi {
        return None;
    }
    let pad = if hi > lo { (hi - lo) * 0.05 } else { lo.abs().max(1.0) * 0.05 };
    Some((lo - pad, hi + pad))
}

/// What a plot says around its curves.
#[derive(Debug, Clone, Copy)]
pub struct Axes<'a> {
    pub title: &'a str,
    pub y_label: &'a str,
    /// Start the y axis at 0 (times, memory), not at the lowest value.
    pub y_from_zero: bool,
}

impl<'a> Axes<'a> {
    pub fn new(title: &'a str, y_label: &'a str) -> Self {
        Self { title, y_label, y_from_zero: false }
    }

    pub fn from_zero(self) -> Self {
        Self { y_from_zero: true, ..self }
    }
}

/// Draws `series` into a PNG at `path`, "step" along the x axis.
pub fn line_plot(path: &Path, axes: &Axes<'_>, series: &[Series]) -> Result<()> {
    font()?;
    let (w, h) = SIZE;
    let mut pixels = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area();
        draw(&root, axes, series).map_err(|e| plot_error(path, e))?;
        root.present().map_err(|e| plot_error(path, e))?;
    }
    save_png(path, &pixels, w, h)
}

type DrawResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn draw(
    root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    axes: &Axes<'_>,
    series: &[Series],
) -> DrawResult<()> {
    let points = || series.iter().flat_map(|s| s.points.iter().copied());
    let (Some(xs), Some(mut ys)) = (range(points().map(|p| p.0)), range(points().map(|p| p.1))) else {
        root.draw(&Text::new("no data", (SIZE.0 as i32 / 2 - 40, SIZE.1 as i32 / 2), ("sans-serif", 24)))?;
        return Ok(());
    };
    if axes.y_from_zero {
        ys.0 = ys.0.min(0.0);
    }
    let mut chart = ChartBuilder::on(root)
        .caption(axes.title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(xs.0.max(0.0)..xs.1, ys.0..ys.1)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(axes.y_label)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(RGBColor(245, 245, 245))
        .draw()?;
    // A faint series shares its colour with the series after it (its moving average).
    let mut k = 0;
    for s in series {
        let color = PALETTE[k % PALETTE.len()];
        k += usize::from(s.style != Style::Faint);
        let data = s.points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite());
        let drawn = match s.style {
            Style::Line => chart.draw_series(LineSeries::new(data, color.stroke_width(2)))?,
            Style::Faint => chart.draw_series(LineSeries::new(data, color.mix(0.3).stroke_width(1)))?,
            Style::Points => {
                chart.draw_series(LineSeries::new(data.clone(), color.stroke_width(1)))?;
                chart.draw_series(data.map(|p| Circle::new(p, 5, color.filled())))?
            }
        };
        let legend = if s.style == Style::Faint { color.mix(0.3).stroke_width(3) } else { color.stroke_width(3) };
        drawn.label(s.name.as_str()).legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], legend));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .draw()?;
    Ok(())
}

fn save_png(path: &Path, pixels: &[u8], w: u32, h: u32) -> Result<()> {
    let file = std::fs::File::create(path).map_err(io(path))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| plot_error(path, e))?;
    writer.write_image_data(pixels).map_err(|e| plot_error(path, e))
}

/// The values of `key` per step in a metrics JSONL file.
pub fn metric_series(path: &Path, key: &str) -> Result<Vec<(f64, f64)>> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_f64()?, v.get(key)?.as_f64()?)))
        .collect())
}

/// The trailing mean over `window` points.
pub fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    (0..points.len())
        .map(|i| {
            let from = (i + 1).saturating_sub(window.max(1));
            let slice = &points[from..=i];
            (points[i].0, slice.iter().map(|p| p.1).sum::<f64>() / slice.len() as f64)
        })
        .collect()
}

/// `reward.png`, `accuracy.png`, `loss.png` and `step_time.png` of a run's `metrics.jsonl`.
pub fn plot_metrics(metrics: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let get = |key: &str| metric_series(metrics, key);
    let window = (get("train/reward_mean")?.len() / 15).clamp(5, 50);
    let noisy = |name: &str, key: &str| -> Result<[Series; 2]> {
        let points = get(key)?;
        Ok([
            Series::new(format!("{name}, per step"), points.clone(), Style::Faint),
            Series::new(format!("{name}, mean of {window} steps"), moving_average(&points, window), Style::Line),
        ])
    };
    let reward = Axes::new("GRPO: reward of the sampled completions", "mean reward");
    line_plot(&dir.join("reward.png"), &reward, &noisy("reward", "train/reward_mean")?)?;
    let mut accuracy = noisy("training prompts", "train/accuracy")?.to_vec();
    accuracy.push(Series::new("held out, sampled", get("eval/accuracy")?, Style::Points));
    accuracy.push(Series::new("held out, greedy", get("eval/accuracy_greedy")?, Style::Points));
    line_plot(&dir.join("accuracy.png"), &Axes::new("GRPO: accuracy", "share correct").from_zero(), &accuracy)?;
    line_plot(&dir.join("loss.png"), &Axes::new("GRPO: loss", "loss"), &noisy("loss", "train/loss")?)?;
    let time = |name: &str, key: &str| -> Result<Series> {
        Ok(Series::new(name, moving_average(&get(key)?, window), Style::Line))
    };
    let title = format!("GRPO: time per step (mean of {window} steps)");
    line_plot(
        &dir.join("step_time.png"),
        &Axes::new(&title, "seconds").from_zero(),
        &[time("step", "time/step_s")?, time("rollout", "time/rollout_s")?, time("update", "time/update_s")?],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plot is a PNG of the expected size with text and lines drawn on it (not blank).
    #[test]
    fn plots_are_drawn() {
        let dir = std::env::temp_dir().join(format!("flashgrpo-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.png");
        let points: Vec<(f64, f64)> = (0..50).map(|i| (i as f64, (i as f64 * 0.3).sin())).collect();
        line_plot(&path, &Axes::new("a title", "y"), &[Series::new("s", points, Style::Line)]).unwrap();
        let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), SIZE);
        let dark = buf.chunks(3).filter(|p| p.iter().all(|&c| c < 100)).count();
        let blue = buf.chunks(3).filter(|p| p[2] > 150 && p[0] < 80).count();
        assert!(dark > 500 && blue > 100, "{dark} dark pixels (text, axes), {blue} blue (the line)");
        line_plot(&path, &Axes::new("empty", "y").from_zero(), &[]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
