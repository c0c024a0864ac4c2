//! A sloppy teacher: worked solutions whose reasoning is right but whose final answer is
//! sometimes copied with its digits reversed (`23+45=68`, answer `86`). The built-in task's SFT
//! warm start learns from such a teacher, so that the policy GRPO starts from computes the right
//! number in its reasoning and then often writes it down wrong: a flaw that SFT on the teacher's
//! data cannot remove and that a reward for the right answer can (docs/BENCHMARKS.md has the runs
//! with and without it).

use flashgrpo_kernels::synthetic::Rng;

use super::Gsm8kProblem;

/// `text` with its digits reversed when it is a number of two digits or more (`68` -> `86`,
/// `120` -> `021`); anything else unchanged.
pub fn reversed_digits(text: &str) -> String {
    if text.len() >= 2 && text.bytes().all(|b| b.is_ascii_digit()) {
        text.chars().rev().collect()
    } else {
        text.to_string()
    }
}

/// The problems as the teacher writes them up: each one's answer, with probability `share`
/// (drawn per problem from `seed`), with its digits reversed. The reasoning is left as it is.
pub fn sloppy_answers(problems: &[Gsm8kProblem], share: f64, seed: u64) -> Vec<Gsm8kProblem> {
    let mut rng = Rng::new(seed ^ 0x5109_7EAC);
    problems
        .iter()
        .map(|p| {
            let flawed = rng.uniform() < share;
            Gsm8kProblem { answer: if flawed { reversed_digits(&p.answer) } else { p.answer.clone() }, ..p.clone() }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverses_multi_digit_answers_at_the_given_rate() {
        assert_eq!(reversed_digits("68"), "86");
        assert_eq!(reversed_digits("120"), "021");
        assert_eq!(reversed_digits("7"), "7");
        assert_eq!(reversed_digits("1,000"), "1,000");
        let problems: Vec<Gsm8kProblem> = (10..2010)
            .map(|i| Gsm8kProblem { question: format!("q{i}"), reasoning: format!("{i}"), answer: i.to_string() })
            .collect();
        let taught = sloppy_answers(&problems, 0.6, 3);
        let flawed = taught.iter().zip(&problems).filter(|(t, p)| t.answer != p.answer).count();
        // Palindromes (11, 22, ...) cannot look flawed; 2000 draws at 0.6: within 4 standard errors.
        assert!((flawed as f64 / 2000.0 - 0.6).abs() < 0.05, "{flawed}");
        assert!(taught.iter().zip(&problems).all(|(t, p)| t.reasoning == p.reasoning));
        assert_eq!(sloppy_answers(&problems, 0.0, 3), problems);
    }
}
