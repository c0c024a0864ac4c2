//! PNG line plots of a run's metrics (reward, accuracy, loss, step time), drawn without a
//! plotting stack: a small RGB raster, lines, and a built-in 5x7 pixel font for titles and tick
//! labels, encoded by the `png` crate. Enough to see a curve at a glance in the output directory.

use std::path::Path;

use serde_json::Value;

use crate::error::{io, Result, TrainError};

const W: usize = 720;
const H: usize = 420;
const LEFT: usize = 90;
const RIGHT: usize = 20;
const TOP: usize = 50;
const BOTTOM: usize = 50;
const COLORS: [[u8; 3]; 4] = [[31, 119, 180], [214, 39, 40], [44, 160, 44], [148, 103, 189]];

/// 5x7 glyphs, one string of 7 rows of 5 pixels each ('#' on).
fn glyph(c: char) -> [&'static str; 7] {
    match c.to_ascii_uppercase() {
        '0' => [" ### ", "#   #", "#  ##", "# # #", "##  #", "#   #", " ### "],
        '1' => ["  #  ", " ##  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
        '2' => [" ### ", "#   #", "    #", "   # ", "  #  ", " #   ", "#####"],
        '3' => ["#####", "   # ", "  #  ", "   # ", "    #", "#   #", " ### "],
        '4' => ["   # ", "  ## ", " # # ", "#  # ", "#####", "   # ", "   # "],
        '5' => ["#####", "#    ", "#### ", "    #", "    #", "#   #", " ### "],
        '6' => ["  ## ", " #   ", "#    ", "#### ", "#   #", "#   #", " ### "],
        '7' => ["#####", "    #", "   # ", "  #  ", " #   ", " #   ", " #   "],
        '8' => [" ### ", "#   #", "#   #", " ### ", "#   #", "#   #", " ### "],
        '9' => [" ### ", "#   #", "#   #", " ####", "    #", "   # ", " ##  "],
        'A' => [" ### ", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
        'B' => ["#### ", "#   #", "#   #", "#### ", "#   #", "#   #", "#### "],
        'C' => [" ### ", "#   #", "#    ", "#    ", "#    ", "#   #", " ### "],
        'D' => ["#### ", "#   #", "#   #", "#   #", "#   #", "#   #", "#### "],
        'E' => ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#####"],
        'F' => ["#####", "#    ", "#    ", "#### ", "#    ", "#    ", "#    "],
        'G' => [" ### ", "#   #", "#    ", "# ###", "#   #", "#   #", " ####"],
        'H' => ["#   #", "#   #", "#   #", "#####", "#   #", "#   #", "#   #"],
        'I' => [" ### ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", " ### "],
        'J' => ["  ###", "   # ", "   # ", "   # ", "   # ", "#  # ", " ##  "],
        'K' => ["#   #", "#  # ", "# #  ", "##   ", "# #  ", "#  # ", "#   #"],
        'L' => ["#    ", "#    ", "#    ", "#    ", "#    ", "#    ", "#####"],
        'M' => ["#   #", "## ##", "# # #", "# # #", "#   #", "#   #", "#   #"],
        'N' => ["#   #", "#   #", "##  #", "# # #", "#  ##", "#   #", "#   #"],
        'O' => [" ### ", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
        'P' => ["#### ", "#   #", "#   #", "#### ", "#    ", "#    ", "#    "],
        'Q' => [" ### ", "#   #", "#   #", "#   #", "# # #", "#  # ", " ## #"],
        'R' => ["#### ", "#   #", "#   #", "#### ", "# #  ", "#  # ", "#   #"],
        'S' => [" ####", "#    ", "#    ", " ### ", "    #", "    #", "#### "],
        'T' => ["#####", "  #  ", "  #  ", "  #  ", "  #  ", "  #  ", "  #  "],
        'U' => ["#   #", "#   #", "#   #", "#   #", "#   #", "#   #", " ### "],
        'V' => ["#   #", "#   #", "#   #", "#   #", "#   #", " # # ", "  #  "],
        'W' => ["#   #", "#   #", "#   #", "# # #", "# # #", "# # #", " # # "],
        'X' => ["#   #", "#   #", " # # ", "  #  ", " # # ", "#   #", "#   #"],
        'Y' => ["#   #", "#   #", " # # ", "  #  ", "  #  ", "  #  ", "  #  "],
        'Z' => ["#####", "    #", "   # ", "  #  ", " #   ", "#    ", "#####"],
        '.' => ["     ", "     ", "     ", "     ", "     ", " ##  ", " ##  "],
        '-' => ["     ", "     ", "     ", "#####", "     ", "     ", "     "],
        '/' => ["    #", "    #", "   # ", "  #  ", " #   ", "#    ", "#    "],
        '_' => ["     ", "     ", "     ", "     ", "     ", "     ", "#####"],
        '(' => ["   # ", "  #  ", " #   ", " #   ", " #   ", "  #  ", "   # "],
        ')' => [" #   ", "  #  ", "   # ", "   # ", "   # ", "  #  ", " #   "],
        ':' => ["     ", " ##  ", " ##  ", "     ", " ##  ", " ##  ", "     "],
        '+' => ["     ", "  #  ", "  #  ", "#####", "  #  ", "  #  ", "     "],
        _ => ["     "; 7],
    }
}

struct Canvas {
    pixels: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Self { pixels: vec![255; W * H * 3] }
    }

    fn set(&mut self, x: i64, y: i64, color: [u8; 3]) {
        if (0..W as i64).contains(&x) && (0..H as i64).contains(&y) {
            let i = (y as usize * W + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&color);
        }
    }

    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), color: [u8; 3], thick: i64) {
        let steps = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            let (x, y) = ((x0 + (x1 - x0) * t).round() as i64, (y0 + (y1 - y0) * t).round() as i64);
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(x + dx - thick / 2, y + dy - thick / 2, color);
                }
            }
        }
    }

    /// Text at `scale` x the 5x7 font, its top-left corner at (x, y).
    fn text(&mut self, x: i64, y: i64, text: &str, scale: i64, color: [u8; 3]) {
        for (k, c) in text.chars().enumerate() {
            let g = glyph(c);
            for (row, bits) in g.iter().enumerate() {
                for (col, b) in bits.bytes().enumerate() {
                    if b == b'#' {
                        for sx in 0..scale {
                            for sy in 0..scale {
                                self.set(
                                    x + (k as i64 * 6 + col as i64) * scale + sx,
                                    y + row as i64 * scale + sy,
                                    color,
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    fn save(&self, path: &Path) -> Result<()> {
        let file = std::fs::File::create(path).map_err(io(path))?;
        let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), W as u32, H as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let png_error = |e: png::EncodingError| TrainError::Other(format!("{}: {e}", path.display()));
        let mut writer = encoder.write_header().map_err(png_error)?;
        writer.write_image_data(&self.pixels).map_err(png_error)?;
        Ok(())
    }
}

fn label(v: f64) -> String {
    if v != 0.0 && (v.abs() < 1e-2 || v.abs() >= 1e5) {
        format!("{v:.1e}")
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// A named series of (x, y) points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Draws `series` into a PNG at `path`, titled `title`, x labelled "step".
pub fn line_plot(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let mut c = Canvas::new();
    let all: Vec<(f64, f64)> =
        series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
    c.text(LEFT as i64, 14, title, 2, [0, 0, 0]);
    let (x0, y0, x1, y1) = (LEFT as f64, TOP as f64, (W - RIGHT) as f64, (H - BOTTOM) as f64);
    let grey = [120, 120, 120];
    for (a, b) in [((x0, y0), (x1, y0)), ((x1, y0), (x1, y1)), ((x1, y1), (x0, y1)), ((x0, y1), (x0, y0))] {
        c.line(a, b, grey, 1);
    }
    if all.is_empty() {
        c.text(LEFT as i64 + 20, (H / 2) as i64, "no data", 2, grey);
        return c.save(path);
    }
    let fold = |f: fn(f64, f64) -> f64, init: f64, pick: fn(&(f64, f64)) -> f64| all.iter().map(pick).fold(init, f);
    let (mut xmin, mut xmax) = (fold(f64::min, f64::INFINITY, |p| p.0), fold(f64::max, f64::NEG_INFINITY, |p| p.0));
    let (mut ymin, mut ymax) = (fold(f64::min, f64::INFINITY, |p| p.1), fold(f64::max, f64::NEG_INFINITY, |p| p.1));
    if xmax <= xmin {
        xmax = xmin + 1.0;
        xmin -= 0.0;
    }
    if ymax <= ymin {
        let pad = ymin.abs().max(1.0) * 0.05;
        (ymin, ymax) = (ymin - pad, ymax + pad);
    }
    let px = |x: f64| x0 + (x - xmin) / (xmax - xmin) * (x1 - x0);
    let py = |y: f64| y1 - (y - ymin) / (ymax - ymin) * (y1 - y0);
    for k in 0..=4 {
        let v = ymin + (ymax - ymin) * k as f64 / 4.0;
        let y = py(v);
        c.line((x0 - 5.0, y), (x0, y), grey, 1);
        let text = label(v);
        c.text(x0 as i64 - 8 - text.len() as i64 * 12, y as i64 - 7, &text, 2, [0, 0, 0]);
    }
    for v in [xmin, (xmin + xmax) / 2.0, xmax] {
        let x = px(v);
        c.line((x, y1), (x, y1 + 5.0), grey, 1);
        let text = format!("{}", v.round());
        c.text(x as i64 - text.len() as i64 * 6, y1 as i64 + 10, &text, 2, [0, 0, 0]);
    }
    c.text((x1 - 60.0) as i64, y1 as i64 + 30, "step", 2, grey);
    for (k, s) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<(f64, f64)> =
            s.points.iter().filter(|(x, y)| x.is_finite() && y.is_finite()).map(|&(x, y)| (px(x), py(y))).collect();
        for w in points.windows(2) {
            c.line(w[0], w[1], color, 2);
        }
        for &p in &points {
            if points.len() < 30 {
                c.line((p.0 - 3.0, p.1), (p.0 + 3.0, p.1), color, 3);
            }
        }
        c.text(LEFT as i64 + 10 + k as i64 * 190, TOP as i64 + 8, &s.name, 2, color);
    }
    c.save(path)
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
    let s = |name: &str, key: &str| -> Result<Series> {
        Ok(Series { name: name.into(), points: metric_series(metrics, key)? })
    };
    let avg = |name: &str, key: &str| -> Result<Series> {
        Ok(Series { name: name.into(), points: moving_average(&metric_series(metrics, key)?, 10) })
    };
    line_plot(
        &dir.join("reward.png"),
        "reward (mean per step)",
        &[s("reward", "train/reward_mean")?, avg("avg 10", "train/reward_mean")?],
    )?;
    line_plot(
        &dir.join("accuracy.png"),
        "accuracy",
        &[s("train", "train/accuracy")?, s("eval", "eval/accuracy")?, avg("train avg 10", "train/accuracy")?],
    )?;
    line_plot(&dir.join("loss.png"), "grpo loss", &[s("loss", "train/loss")?])?;
    line_plot(
        &dir.join("step_time.png"),
        "time per step (s)",
        &[s("step", "time/step_s")?, s("update", "time/update_s")?, s("rollout", "time/rollout_s")?],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_character_has_a_glyph() {
        for c in "0123456789abcdefghijklmnopqrstuvwxyz.-/_():+".chars() {
            assert!(glyph(c).iter().any(|r| r.contains('#')), "{c}");
            assert!(glyph(c).iter().all(|r| r.len() == 5), "{c}");
        }
    }
}
