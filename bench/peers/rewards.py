"""The rewards of flashgrpo's built-in task and GSM8K runs (crates/train/src/rewards.rs), in
Python for TRL's GRPOTrainer: correctness (the last number of the answer section equals the gold
answer as a number), strict format (exactly `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`)
and tag count (0.25 per tag present exactly once). Same definitions, same weights (1.0, 0.5, 0.5)."""

TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
NAMES = ["correctness", "strict_format", "tag_count"]
DEFAULT_WEIGHTS = [1.0, 0.5, 0.5]


def parse_number(text):
    cleaned = text.strip().lstrip("$").rstrip(".%").replace(",", "")
    if not cleaned or not any(c.isdigit() for c in cleaned):
        return None
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


def last_number(text):
    """The last run of digits with optional sign, thousands commas and decimals."""
    end = len(text)
    while end > 0:
        last_digit = max((i for i in range(end) if text[i].isdigit()), default=None)
        if last_digit is None:
            return None
        start = last_digit
        while start > 0:
            c = text[start - 1]
            digit_before = start >= 2 and text[start - 2].isdigit()
            if c.isdigit() or (c in ",." and digit_before):
                start -= 1
            else:
                break
        if start > 0 and text[start - 1] == "-":
            start -= 1
        value = parse_number(text[start : last_digit + 1])
        if value is not None:
            return value
        end = start
    return None


def numbers_equal(a, b):
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def answer_section(completion):
    i = completion.rfind("<answer>")
    if i < 0:
        return completion
    rest = completion[i + len("<answer>") :]
    j = rest.find("</answer>")
    return rest if j < 0 else rest[:j]


def correctness(completion, gold):
    a = last_number(answer_section(completion))
    g = parse_number(gold)
    if g is None:
        g = last_number(gold)
    return 1.0 if a is not None and g is not None and numbers_equal(a, g) else 0.0


def strict_format(completion):
    body = completion[:-1] if completion.endswith("\n") else completion
    if not body.startswith("<think>\n"):
        return 0.0
    think, sep, rest = body[len("<think>\n") :].partition("\n</think>\n<answer>\n")
    if not sep or not rest.endswith("\n</answer>"):
        return 0.0
    answer = rest[: -len("\n</answer>")]
    return 1.0 if all(t not in think and t not in answer for t in TAGS) else 0.0


def tag_count(completion):
    return 0.25 * sum(1 for t in TAGS if completion.count(t) == 1)


def trl_reward_funcs():
    """The three rewards as TRL reward functions (`completions`, the dataset's `answer` column)."""

    def correctness_reward(completions, answer, **kwargs):
        return [correctness(c, a) for c, a in zip(completions, answer)]

    def strict_format_reward(completions, **kwargs):
        return [strict_format(c) for c in completions]

    def tag_count_reward(completions, **kwargs):
        return [tag_count(c) for c in completions]

    return [correctness_reward, strict_format_reward, tag_count_reward]
