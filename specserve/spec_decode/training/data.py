"""Self-distillation data for draft heads: the target's own answers and final hidden states.

Three prompt sources, none from Spec-Bench (the benchmark prompts stay out of training):

  * `instruction_prompts`: templates (writing, coding, math, QA, summarisation, roleplay,
    extraction, reasoning, ...) over a few dozen topics;
  * `self_instruct_prompts`: the target writes the questions itself, one per seed word drawn
    from its own vocabulary (thousands of topics the templates never name);
  * `document_prompts`: long-context tasks (summarise, answer from a passage, extract, rewrite,
    translate, continue) over documents made of the target's earlier answers, so the head
    learns to copy from context as summarisation and RAG need.

`generate_chunks` runs the engine (greedy, prefix caching off) over them in chunks and records,
from each step's StepLogits.all_hidden, the final hidden state of every computed token; each
chunk is saved as one .pt file, so an interrupted run resumes at the next missing chunk.

A saved sequence is {"tokens": int32 [n], "hidden": float16 [m, hidden], "prompt_len": int}
where hidden row t is f_t, the target's feature at position t (it predicts token t+1), and
m <= n (the last sampled token is never fed back); for an EAGLE-3 head also "aux": float16
[m, hidden * 3], the outputs of the target layers its features fuse, and the sequence may
start inside the prompt (its last `prompt_rows` tokens).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

TOPICS = ["the ocean", "a small bakery", "volcanoes", "the moon landing", "honey bees", "a lost key",
          "city parks", "electric cars", "ancient Rome", "a rainy Monday", "chess", "coffee",
          "mountain hiking", "a robot gardener", "the water cycle", "friendship", "solar panels",
          "a haunted library", "recycling", "the first day of school", "dinosaurs", "jazz music",
          "a desert caravan", "photosynthesis", "a lighthouse keeper", "time management",
          "the immune system", "a space station", "winter holidays", "public transport",
          "a village market", "machine learning", "the printing press", "rivers", "penguins",
          "a job interview", "healthy breakfast", "the internet", "a old bicycle", "kindness"]
STYLES = ["a short poem", "a haiku", "a short story", "a blog post", "a limerick", "a product description",
          "a diary entry", "a news headline and summary", "a motivational speech", "a letter to a friend"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
              "finds the largest element in a list", "counts the vowels in a sentence",
              "merges two sorted lists", "removes duplicates from a list", "computes Fibonacci numbers",
              "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
              "sorts a list of dictionaries by a key", "reads a CSV file and sums a column",
              "implements binary search", "flattens a nested list", "counts word frequencies"]
LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "a shell script"]
PEOPLE = ["a pirate", "a medieval knight", "a friendly tour guide", "a detective", "a chef",
          "a grumpy wizard", "a sports commentator", "a kind teacher", "an astronaut", "a librarian"]
QUESTIONS = ["Why is the sky blue?", "How do airplanes stay in the air?", "What causes the seasons?",
             "How does a refrigerator work?", "Why do cats purr?", "What is inflation?",
             "How do vaccines work?", "What is the difference between weather and climate?",
             "Why do leaves change color in autumn?", "How does a compass work?",
             "What is a black hole?", "How are rainbows formed?", "What does DNA do?",
             "Why is exercise good for the brain?", "How does the stock market work?",
             "What is the speed of light?", "Why do we dream?", "How do bees make honey?"]
NAMES = ["Alice", "Bob", "Chen", "Dmitri", "Elena", "Farah", "Gus", "Hana", "Ivan", "Julia"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Hanoi", "Dublin"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    return rng.choice([
        f"What is {a} times {b}? Show your steps.",
        f"A shop sells pencils at {c} dollars each. How much do {a} pencils cost?",
        f"Solve for x: {c}x + {a} = {a + c * b}.",
        f"If a train travels {a} km in {c} hours, what is its average speed?",
        f"What is {a}% of {b * 10}? Explain briefly.",
        f"{rng.choice(NAMES)} has {a} apples and gives away {min(a, b)}. How many are left?",
        f"Is {a * b + 1} an even or odd number? Explain why.",
    ])


def _extraction(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    city = rng.choice(CITIES)
    text = (f"{n1} met {n2} in {city} on March {rng.randint(1, 28)}, {rng.randint(1990, 2023)}. "
            f"They discussed {rng.choice(TOPICS)} and agreed to meet again in {rng.choice(CITIES)}.")
    return rng.choice([f"Extract all names, places and dates from this text as a list: {text}",
                       f"Return a JSON object with the people and cities mentioned: {text}",
                       f"Summarize this in one sentence: {text}"])


def _one(rng: random.Random) -> str:
    t = rng.choice(TOPICS)
    kind = rng.randrange(10)
    if kind == 0:
        return f"Write {rng.choice(STYLES)} about {t}."
    if kind == 1:
        return f"Write a function in {rng.choice(LANGS)} that {rng.choice(CODE_TASKS)}."
    if kind == 2:
        return _math(rng)
    if kind == 3:
        return rng.choice(QUESTIONS)
    if kind == 4:
        return f"Pretend you are {rng.choice(PEOPLE)}. Describe {t} in your own voice."
    if kind == 5:
        return _extraction(rng)
    if kind == 6:
        return rng.choice([f"Give me three tips about {t}.", f"List five facts about {t}.",
                           f"What are the pros and cons of {t}?", f"Explain {t} to a child."])
    if kind == 7:
        a, b = rng.sample(TOPICS, 2)
        return rng.choice([f"Compare {a} and {b}.", f"How are {a} and {b} connected?",
                           f"Write a short dialogue between two friends about {a}."])
    if kind == 8:
        return rng.choice([f"Explain step by step how to plan a trip to {rng.choice(CITIES)}.",
                           ("If all birds can fly and a penguin is a bird, can a penguin fly? "
                            "Explain the flaw in the reasoning."),
                           f"What would happen if {t} disappeared tomorrow? Reason it through.",
                           f"Write an email to {rng.choice(NAMES)} about {t}."])
    return rng.choice([f"Translate into French: 'I love {t}.'", f"Write a title and outline for an essay on {t}.",
                       f"Fix the grammar: 'me and {rng.choice(NAMES)} goes to {rng.choice(CITIES)} yesterday.'",
                       f"Describe a day in the life of someone who works with {t}."])


def instruction_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    seen, out, draws = set(), [], 0
    while len(out) < n:
        p = _one(rng)
        draws += 1
        if p not in seen or draws > 50 * n:  # templates exhausted: allow repeats
            seen.add(p)
            out.append(p)
    return out


def seed_words(tokenizer, n: int, seed: int = 0) -> list[str]:
    """n distinct lower-case English-looking words from the tokenizer's vocabulary (tokens that
    start a word, letters only, at least 5 letters), in a seeded random order."""
    vocab = tokenizer.get_vocab()
    words = sorted({w[1:] for w in vocab if w[:1] in ("\u0120", "\u2581") and w[1:].isalpha()
                    and w[1:].islower() and len(w) >= 6})
    random.Random(seed).shuffle(words)
    return words[:n]


ASK = ["Write one question that a curious person might ask an assistant about '{w}'.",
       "Write one instruction that asks an assistant to write something about '{w}'.",
       "Write one practical question about '{w}' that someone might search for.",
       "Write one request for help with a task that involves '{w}'."]


def self_instruct_words(n: int) -> int:
    """Seed words spent on n self-instruct prompts (some answers are not usable prompts)."""
    return n + n // 4


def self_instruct_prompts(llm, n: int, seed: int = 0, log=print, skip: int = 0) -> list[str]:
    """Up to n prompts written by the target, greedily (the seed words make them differ), one
    per seed word: the first line of each answer (or its longest quoted part), when 12-300
    characters long. skip: seed words already spent (by an earlier call with the same seed),
    so a set can grow without repeating them."""
    from specserve.request import SamplingParams

    rng = random.Random(seed + skip)
    words = seed_words(llm.get_tokenizer(), skip + self_instruct_words(n), seed)[skip:]
    convs = [[{"role": "user", "content": rng.choice(ASK).format(w=w)}] for w in words]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=True)
    prompts: dict[str, None] = {}  # first occurrence order, no repeats
    for o in outs:
        line = o.outputs[0].text.strip().split("\n")[0].strip()
        quoted = max(line.split('"')[1::2], key=len, default="")
        line = (quoted if len(quoted) >= 12 else line).strip('"').strip()
        if 12 <= len(line) <= 300:
            prompts.setdefault(line)
    log(f"data: the target wrote {len(prompts)} prompts from {len(words)} seed words")
    return list(prompts)[:n]


DOC_TASKS = ["Summarize the following text in a few sentences.\n\n{d}",
             "{d}\n\nWrite a one-paragraph summary of the text above.",
             "Read the passage and answer the question.\n\nPassage: {d}\n\nQuestion: {q}",
             "Using only the information in the documents below, answer: {q}\n\n{d}",
             "List the main points of this text as bullet points.\n\n{d}",
             "Rewrite the following text in simpler words.\n\n{d}",
             "Translate the first two sentences of this text into {lang}.\n\n{d}",
             "Extract the key terms from this text and explain each in one line.\n\n{d}",
             "{d}\n\nContinue the text above with one more paragraph in the same style.",
             "Give this text a title, then quote its most important sentence.\n\n{d}"]
QUESTION_STEMS = ["What is the main idea of the passage?", "What does the text say about {w}?",
                  "Which details support the author's point?", "What example does the text give?",
                  "According to the text, why does this matter?", "What is mentioned first?"]


def document_prompts(texts: list[str], n: int, seed: int = 0, parts: tuple[int, int] = (2, 4)) -> list[str]:
    """n long-context prompts; each document joins 2-4 of `texts` (the target's own answers)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        doc = "\n\n".join(rng.sample(texts, rng.randint(*parts)))
        word = rng.choice([w for w in doc.split() if w.isalpha() and len(w) > 5] or ["it"])
        out.append(rng.choice(DOC_TASKS).format(
            d=doc, q=rng.choice(QUESTION_STEMS).format(w=word),
            lang=rng.choice(["French", "German", "Spanish", "Italian"])))
    return out


def generate_chunks(llm, prompts: list[str], out_dir: Path, chunk: int, max_tokens: int,
                    deadline: float, log=print, prefix: str = "chunk",
                    prompt_rows: int | None = None) -> list[Path]:
    """Greedy answers + final hidden states (and, when the engine's model has aux layers, their
    outputs: "aux", float16 [m, hidden * layers]), one file per chunk of prompts (skips done
    chunks); files are named PREFIX_NNNNN.pt. prompt_rows: keep only the last this many prompt
    tokens of each sequence (the EAGLE head's first pass reads no more: eagle.PROMPT_WINDOW)."""
    from specserve.request import SamplingParams

    out_dir.mkdir(parents=True, exist_ok=True)
    runner = llm.engine.runner
    captured: dict[str, dict[int, torch.Tensor]] = {}

    def capture(sched, features: torch.Tensor) -> None:
        hidden, off = features.to("cpu", torch.float16), 0  # one copy per step
        for req, n in zip(sched.requests, sched.num_tokens):
            rows = captured.setdefault(req.request_id, {})
            for j in range(n):
                rows[req.num_computed_tokens + j] = hidden[off + j]
            off += n

    runner.hidden_hooks.append(capture)
    files = []
    try:
        for i in range(0, len(prompts), chunk):
            path = out_dir / f"{prefix}_{i // chunk:05d}.pt"
            if path.exists():
                files.append(path)
                continue
            if time.time() > deadline:
                log(f"data: time budget reached after {len(files)} chunks")
                break
            t0 = time.time()
            convs = [[{"role": "user", "content": p}] for p in prompts[i:i + chunk]]
            outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            seqs = []
            width = runner.arch.hidden_size
            for o in outs:
                tokens = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                rows = captured.pop(o.request_id)
                m = max(rows) + 1
                assert all(t in rows for t in range(m)), "a computed position is missing"
                first = 0 if prompt_rows is None else max(0, len(o.prompt_token_ids) - prompt_rows)
                table = torch.stack([rows[t] for t in range(first, m)])
                seq = {"tokens": torch.tensor(tokens[first:], dtype=torch.int32),
                       "hidden": table[:, :width].contiguous(), "prompt_len": len(o.prompt_token_ids) - first}
                if table.shape[1] > width:
                    seq["aux"] = table[:, width:].contiguous()
                seqs.append(seq)
            captured.clear()
            torch.save(seqs, path)
            files.append(path)
            ntok = sum(len(s["tokens"]) - s["prompt_len"] for s in seqs)
            log(f"data: {prefix} {i // chunk} ({len(seqs)} answers, {ntok} tokens) "
                f"in {time.time() - t0:.0f} s")
    finally:
        runner.hidden_hooks.remove(capture)
    return files
