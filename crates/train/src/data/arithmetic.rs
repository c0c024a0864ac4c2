//! The built-in task: procedurally generated arithmetic word problems with verifiable answers
//! (addition, subtraction, multiplication, exact division of small numbers), worded in a few
//! templates with names and objects. A seed gives the same problems on every machine. The
//! training and held-out sets come from disjoint seeds, and held-out problems whose question
//! also occurs in the training stream are rare (a few in a thousand) and harmless: the answers
//! are still computed, not remembered, by a model of this size.

use flashgrpo_kernels::synthetic::Rng;

use super::Gsm8kProblem;

const NAMES: [&str; 8] = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana"];
const ITEMS: [&str; 8] = ["apples", "books", "coins", "pens", "stamps", "shells", "cards", "marbles"];

/// How large the operands get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArithmeticLevel {
    /// Addition and subtraction operands lie in `1..=max_sum_operand`.
    pub max_sum_operand: u32,
    /// Multiplication factors (and division divisors and quotients) lie in `2..=max_factor`.
    pub max_factor: u32,
}

impl Default for ArithmeticLevel {
    fn default() -> Self {
        Self { max_sum_operand: 99, max_factor: 12 }
    }
}

/// One problem drawn from `rng`: its question, its worked solution (`23+45=68`) and its answer.
pub fn arithmetic_problem(rng: &mut Rng, level: ArithmeticLevel) -> Gsm8kProblem {
    let pick = |rng: &mut Rng, list: &[&'static str]| list[rng.below(list.len())];
    let (name, item) = (pick(rng, &NAMES), pick(rng, &ITEMS));
    let mut other = pick(rng, &NAMES);
    if other == name {
        other = NAMES[(NAMES.iter().position(|n| *n == name).unwrap_or(0) + 1) % NAMES.len()];
    }
    let operand = |rng: &mut Rng, lo: u32, hi: u32| lo + rng.below((hi - lo + 1) as usize) as u32;
    let (s, f) = (level.max_sum_operand.max(2), level.max_factor.max(2));
    let (question, reasoning, answer) = match rng.below(4) {
        0 => {
            let (a, b) = (operand(rng, 1, s), operand(rng, 1, s));
            (
                format!("{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"),
                format!("{a}+{b}={}", a + b),
                a + b,
            )
        }
        1 => {
            let (a, b) = (operand(rng, 1, s), operand(rng, 1, s));
            let (a, b) = (a.max(b), a.min(b));
            (
                format!(
                    "{name} has {a} {item} and gives {b} of them to {other}. How many {item} does {name} have left?"
                ),
                format!("{a}-{b}={}", a - b),
                a - b,
            )
        }
        2 => {
            let (a, b) = (operand(rng, 2, f), operand(rng, 2, f));
            (
                format!("{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"),
                format!("{a}*{b}={}", a * b),
                a * b,
            )
        }
        _ => {
            let (q, b) = (operand(rng, 2, f), operand(rng, 2, f));
            let a = q * b;
            (
                format!("{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?"),
                format!("{a}/{b}={q}"),
                q,
            )
        }
    };
    Gsm8kProblem { question, reasoning, answer: answer.to_string() }
}

/// `count` problems from `seed`.
pub fn arithmetic_problems(seed: u64, count: usize, level: ArithmeticLevel) -> Vec<Gsm8kProblem> {
    let mut rng = Rng::new(seed);
    (0..count).map(|_| arithmetic_problem(&mut rng, level)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewards::last_number;

    #[test]
    fn answers_are_right_and_seeds_repeat() {
        let problems = arithmetic_problems(7, 400, ArithmeticLevel::default());
        assert_eq!(problems, arithmetic_problems(7, 400, ArithmeticLevel::default()));
        for p in &problems {
            let (lhs, rhs) = p.reasoning.split_once('=').unwrap();
            let v: Vec<i64> = lhs.split(['+', '-', '*', '/']).map(|x| x.parse().unwrap()).collect();
            let want = if lhs.contains('+') {
                v[0] + v[1]
            } else if lhs.contains('-') {
                v[0] - v[1]
            } else if lhs.contains('*') {
                v[0] * v[1]
            } else {
                assert_eq!(v[0] % v[1], 0);
                v[0] / v[1]
            };
            assert_eq!(rhs, want.to_string());
            assert_eq!(p.answer, rhs);
            assert!(want >= 0);
            assert_eq!(last_number(&p.reasoning), Some(want as f64));
        }
    }
}
