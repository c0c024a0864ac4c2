//! The rewards of the original GSM8K GRPO system, weights [1.0, 0.5, 0.5]:
//! - **correctness**: the last number of the answer (the text inside the last
//!   `<answer>...</answer>`, or the whole completion when there is none) equals the gold answer
//!   as a number (`1,000`, `1000.0`, `$1000` and `1000` are equal): 1 or 0;
//! - **strict format**: the completion is exactly `<think>\n...\n</think>\n<answer>\n...\n</answer>`
//!   (one optional trailing newline; the sections may span lines): 1 or 0;
//! - **tag count**: 0.25 for each of the four tags present exactly once.
//!
//! The built-in arithmetic task uses the same three, so one trainer serves both.

use serde::{Deserialize, Serialize};

/// The reward functions, in the order of their weights.
pub const REWARD_NAMES: [&str; 3] = ["correctness", "strict_format", "tag_count"];

/// The original's weights.
pub const DEFAULT_WEIGHTS: [f64; 3] = [1.0, 0.5, 0.5];

const TAGS: [&str; 4] = ["<think>", "</think>", "<answer>", "</answer>"];

/// A number as people write it in answers: thousands separators, a currency sign, a trailing
/// period or percent sign are ignored.
pub fn parse_number(text: &str) -> Option<f64> {
    let cleaned: String = text.trim().trim_start_matches('$').trim_end_matches(['.', '%']).replace(',', "");
    if cleaned.is_empty() || !cleaned.bytes().any(|b| b.is_ascii_digit()) {
        return None;
    }
    cleaned.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// The last number in `text`: a run of digits with optional sign, thousands commas and decimals.
pub fn last_number(text: &str) -> Option<f64> {
    let bytes = text.as_bytes();
    let mut end = bytes.len();
    while end > 0 {
        // Find the last digit at or before `end`.
        let last_digit = bytes[..end].iter().rposition(u8::is_ascii_digit)?;
        let mut start = last_digit;
        while start > 0 {
            let c = bytes[start - 1];
            let digit_before = start >= 2 && bytes[start - 2].is_ascii_digit();
            if c.is_ascii_digit() || ((c == b',' || c == b'.') && digit_before) {
                start -= 1;
            } else {
                break;
            }
        }
        if start > 0 && bytes[start - 1] == b'-' {
            start -= 1;
        }
        if let Some(v) = parse_number(&text[start..=last_digit]) {
            return Some(v);
        }
        end = start;
    }
    None
}

/// Equal as numbers (relative 1e-9, so `0.1 + 0.2` style noise in written answers does not count).
pub fn numbers_equal(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// The text the answer is read from: inside the last `<answer>...</answer>` (or after the last
/// `<answer>` when it is not closed), else the whole completion.
pub fn answer_section(completion: &str) -> &str {
    match completion.rfind("<answer>") {
        Some(i) => {
            let rest = &completion[i + "<answer>".len()..];
            rest.find("</answer>").map_or(rest, |j| &rest[..j])
        }
        None => completion,
    }
}

/// 1 when the answer's last number equals `gold`.
pub fn correctness(completion: &str, gold: &str) -> f64 {
    match (last_number(answer_section(completion)), parse_number(gold).or_else(|| last_number(gold))) {
        (Some(a), Some(g)) if numbers_equal(a, g) => 1.0,
        _ => 0.0,
    }
}

/// 1 when the completion is exactly the think-then-answer layout.
pub fn strict_format(completion: &str) -> f64 {
    let body = completion.strip_suffix('\n').unwrap_or(completion);
    let ok = (|| {
        let rest = body.strip_prefix("<think>\n")?;
        let (think, rest) = rest.split_once("\n</think>\n<answer>\n")?;
        let answer = rest.strip_suffix("\n</answer>")?;
        let clean = |s: &str| TAGS.iter().all(|t| !s.contains(t));
        (clean(think) && clean(answer)).then_some(())
    })();
    if ok.is_some() {
        1.0
    } else {
        0.0
    }
}

/// 0.25 for each tag present exactly once.
pub fn tag_count(completion: &str) -> f64 {
    TAGS.iter().filter(|t| completion.matches(*t).count() == 1).count() as f64 * 0.25
}

/// The reward a completion's `scores` make under `weights` (TRL's `reward_weights`).
pub fn weighted(scores: &[f64], weights: &[f64]) -> f64 {
    scores.iter().zip(weights).map(|(s, w)| s * w).sum()
}

/// The three rewards of one completion.
pub fn score(completion: &str, gold: &str) -> [f64; 3] {
    [correctness(completion, gold), strict_format(completion), tag_count(completion)]
}

/// The reasoning and answer in the format the rewards ask for (SFT targets, and the maximum).
pub fn formatted(reasoning: &str, answer: &str) -> String {
    format!("<think>\n{}\n</think>\n<answer>\n{}\n</answer>", reasoning.trim(), answer.trim())
}

/// How rewards are scaled into advantages (TRL's `scale_rewards`: a name, or TRL's booleans,
/// `true` for `group` and `false` for `none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// `(r - mean_group) / (std_group + eps)`.
    #[default]
    Group,
    /// `(r - mean_group) / (std_batch + eps)`.
    Batch,
    /// `r - mean_group`.
    None,
}

impl<'de> Deserialize<'de> for ScaleRewards {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl serde::de::Visitor<'_> for Names {
            type Value = ScaleRewards;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("`group`, `batch`, `none`, or TRL's `true` (group) / `false` (none)")
            }

            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<ScaleRewards, E> {
                Ok(if v { ScaleRewards::Group } else { ScaleRewards::None })
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ScaleRewards, E> {
                match v {
                    "group" => Ok(ScaleRewards::Group),
                    "batch" => Ok(ScaleRewards::Batch),
                    "none" => Ok(ScaleRewards::None),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(Names)
    }
}

/// How several reward functions make one advantage (TRL's `multi_objective_aggregation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// The weighted sum of the rewards, then scaled as `scale_rewards` says ([`advantages`]).
    #[default]
    SumThenNormalize,
    /// Each reward normalised within its group (`(r_k - mean_k) / (std_k + eps)`), the weighted
    /// sum of those, then normalised over the whole batch (`scale_rewards` is not used): a reward
    /// with a large range no longer drowns the others.
    NormalizeThenSum,
}

/// The sample standard deviation, n - 1 as `torch.std` (0 for fewer than two values).
pub(crate) fn sample_std(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

/// `(x - mean) / scale` over `values`; 0 where they are all equal (no signal), also with a scale
/// of 0.
fn centred(values: &[f64], mean: f64, scale: f64) -> impl Iterator<Item = f64> + '_ {
    let flat = values.iter().all(|r| *r == values[0]);
    values.iter().map(move |r| if flat { 0.0 } else { (r - mean) / scale })
}

fn mean_of(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Group-relative advantages of `rewards`, laid out group after group (`group` completions per
/// prompt). Standard deviations are unbiased (n - 1), as `torch.std` in TRL.
pub fn advantages(rewards: &[f64], group: usize, scale: ScaleRewards, eps: f64) -> Vec<f64> {
    let batch_std = sample_std(rewards);
    rewards
        .chunks(group.max(1))
        .flat_map(|g| {
            let scale = match scale {
                ScaleRewards::Group => sample_std(g) + eps,
                ScaleRewards::Batch => batch_std + eps,
                ScaleRewards::None => 1.0,
            };
            centred(g, mean_of(g), scale).collect::<Vec<_>>()
        })
        .collect()
}

/// TRL's `normalize_then_sum` advantages of per-completion `scores` (one value per reward
/// function), laid out group after group: each reward standardised within its group, the
/// weighted sum of those standardised over the whole batch.
pub fn advantages_normalize_then_sum<S: AsRef<[f64]>>(
    scores: &[S],
    weights: &[f64],
    group: usize,
    eps: f64,
) -> Vec<f64> {
    let mut summed = vec![0.0; scores.len()];
    for (k, w) in weights.iter().enumerate() {
        let column: Vec<f64> = scores.iter().map(|s| s.as_ref()[k]).collect();
        for (rows, g) in summed.chunks_mut(group.max(1)).zip(column.chunks(group.max(1))) {
            for (total, z) in rows.iter_mut().zip(centred(g, mean_of(g), sample_std(g) + eps)) {
                *total += w * z;
            }
        }
    }
    centred(&summed, mean_of(&summed), sample_std(&summed) + eps).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_compared_as_numbers() {
        for (text, want) in [("1,000", 1000.0), ("1000.0", 1000.0), ("$1000", 1000.0), ("-3.5", -3.5), ("18.", 18.0)] {
            assert_eq!(parse_number(text), Some(want), "{text}");
        }
        assert_eq!(last_number("she paid $1,250.50 for 3 items"), Some(3.0));
        assert_eq!(last_number("so 16 - 3 - 4 = 9, and 9 * 2 = 18."), Some(18.0));
        assert_eq!(last_number("total: 1,000"), Some(1000.0));
        assert_eq!(last_number("the change is -5"), Some(-5.0));
        assert_eq!(last_number("no digits"), None);
        assert_eq!(correctness("<answer>\n1,000\n</answer>", "1000"), 1.0);
        assert_eq!(correctness("<answer>1000.0</answer>", "1000"), 1.0);
        assert_eq!(correctness("<answer>999</answer> 1000", "1000"), 0.0);
    }

    #[test]
    fn format_rewards() {
        let good = formatted("2+3=5\n5*2=10", "10");
        assert_eq!(score(&good, "10"), [1.0, 1.0, 1.0]);
        assert_eq!(strict_format(&format!("{good}\n")), 1.0);
        assert_eq!(strict_format(&format!("x{good}")), 0.0);
        assert_eq!(tag_count("<think>\nx\n</think>\n<answer>"), 0.75);
        assert_eq!(tag_count("<think><think></think>"), 0.25);
    }

    #[test]
    fn group_advantages() {
        let a = advantages(&[1.0, 0.0, 1.0, 0.0, 2.0, 2.0], 2, ScaleRewards::Group, 0.0);
        let s = (0.5f64).sqrt();
        assert_eq!(
            a[..4].iter().map(|x| (x * 1e9).round()).collect::<Vec<_>>(),
            [(0.5 / s * 1e9).round(), (-0.5 / s * 1e9).round(), (0.5 / s * 1e9).round(), (-0.5 / s * 1e9).round()]
        );
        assert_eq!(&a[4..], &[0.0, 0.0]);
        assert_eq!(advantages(&[1.0, 0.0], 2, ScaleRewards::None, 1e-4), vec![0.5, -0.5]);
    }

    /// TRL 1.16's `normalize_then_sum`, written out for two groups of three and two rewards:
    /// per reward and group `(r - mean) / (std + eps)` (unbiased std), weighted sum, then the
    /// batch's `(x - mean) / (std + eps)`.
    #[test]
    fn normalize_then_sum_is_trls() {
        let scores = [[1.0, 0.0], [0.0, 0.5], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]];
        let (weights, eps) = ([1.0, 0.5], 1e-4);
        let got = advantages_normalize_then_sum(&scores, &weights, 3, eps);
        // By hand: group 1, reward 0: mean 2/3, std sqrt(1/3); reward 1: mean 0.5, std 0.5.
        // Group 2, reward 0: all 0 (flat: 0); reward 1: mean 1/3, std sqrt(1/3).
        let z = |x: f64, m: f64, s: f64| (x - m) / (s + eps);
        let (s1, s2) = ((1.0f64 / 3.0).sqrt(), 0.5);
        let summed = [
            z(1.0, 2.0 / 3.0, s1) + 0.5 * z(0.0, 0.5, s2),
            z(0.0, 2.0 / 3.0, s1) + 0.5 * z(0.5, 0.5, s2),
            z(1.0, 2.0 / 3.0, s1) + 0.5 * z(1.0, 0.5, s2),
            0.5 * z(0.0, 1.0 / 3.0, s1),
            0.5 * z(0.0, 1.0 / 3.0, s1),
            0.5 * z(1.0, 1.0 / 3.0, s1),
        ];
        let m = summed.iter().sum::<f64>() / 6.0;
        let sd = (summed.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 5.0).sqrt();
        for (g, x) in got.iter().zip(summed) {
            assert!((g - (x - m) / (sd + eps)).abs() < 1e-12, "{got:?}");
        }
        // Standardised over the batch: mean 0, unbiased std 1 (up to eps).
        let mean = got.iter().sum::<f64>() / 6.0;
        let var = got.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / 5.0;
        assert!(mean.abs() < 1e-12 && (var.sqrt() - 1.0).abs() < 1e-3, "{mean} {var}");
    }
}
