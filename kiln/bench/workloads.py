"""Benchmark workloads: random prose, shared-prefix groups, multi-turn chats, and JSONL files.

Every prompt length is counted with the model's tokenizer (special tokens excluded).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

_WORDS = """
the of and to in is that it was for on are as with his they at be this from have or by one had not but what
all were when we there can an your which their said if do will each about how up out them then she many some so
these would other into has more her two like him see time could no make than first been its who now people my made
over did down only way find use may water long little very after words called just where most know get through
back much before go good new write our used me man too any day same right look think also around another came come
work three word must because does part even place well such here take why things help put years different away
again off went old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought both few those
always looked show large often together asked house world going want school important until form food keep children
feet land side without boy once animals life enough took sometimes four head above kind began almost live page got
earth need far hand high year mother light parts country father let night following picture being study second eyes
soon times story boys since white days ever paper hard near sentence better best across during today others however
sure means knew try told young miles sun ways thing whole hear example heard several change answer room sea against
top turned learn point city play toward five using himself usually river garden market winter summer morning letter
""".split()
_QUESTION_STARTS = ("What", "Why", "How", "Where", "When", "Which")


@dataclass
class Turn:
    """One user message: its text, its token count, and the tokens to generate for it."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class Conversation:
    """A single request (one turn) or a multi-turn chat whose turns are sent one after another."""

    turns: list[Turn] = field(default_factory=list)


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def prose(rng: random.Random, num_words: int) -> str:
    """Sentences of real English words (6-16 words each), deterministic for a seeded rng."""
    sentences, left = [], max(1, num_words)
    while left > 0:
        n = min(left, rng.randint(6, 16))
        words = [rng.choice(_WORDS) for _ in range(n)]
        if n > 6 and rng.random() < 0.3:
            words[rng.randint(2, n - 3)] += ","
        sentences.append(" ".join(words).capitalize() + ".")
        left -= n
    return " ".join(sentences)


def fit_to_tokens(tokenizer: Any, text: str, n: int) -> str:
    """Cut `text` so it encodes to exactly `n` tokens (closest reachable count if BPE merges forbid it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"text has {len(ids)} tokens, fewer than the {n} asked for")
    best, best_err, m = text, None, n
    for _ in range(12):
        m = min(max(m, 1), len(ids))
        cand = tokenizer.decode(ids[:m])
        k = count_tokens(tokenizer, cand)
        if k == n:
            return cand
        if best_err is None or abs(k - n) < best_err:
            best, best_err = cand, abs(k - n)
        m += n - k
    return best


def text_of_tokens(tokenizer: Any, n: int, rng: random.Random, head: str = "") -> str:
    """`head` followed by prose, exactly `n` tokens in all."""
    if n <= 0:
        return ""
    text = head + prose(rng, n)
    for _ in range(20):
        if count_tokens(tokenizer, text) >= n:
            break
        text += " " + prose(rng, n)
    return fit_to_tokens(tokenizer, text, n)


def sample_lens(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """`n` lengths uniform in [max(1, int(length * range_ratio)), length] (SGLang's --random-range-ratio)."""
    lo = min(length, max(1, int(length * range_ratio)))
    return [rng.randint(lo, length) for _ in range(n)]


def random_workload(
    tokenizer: Any, num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Conversation]:
    rng = random.Random(seed)
    in_lens = sample_lens(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lens(rng, num_prompts, output_len, range_ratio)
    return [
        Conversation([Turn(text_of_tokens(tokenizer, i, rng), i, o)])
        for i, o in zip(in_lens, out_lens, strict=True)
    ]


def shared_prefix_workload(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    """G groups of Q prompts; each prompt is its group's system prompt + a distinct question."""
    rng = random.Random(seed)
    convs = []
    for g in range(num_groups):
        system = text_of_tokens(tokenizer, system_prompt_len, rng, head=f"Document {g + 1}. ")
        total = system_prompt_len + question_len
        for q in range(prompts_per_group):
            head = f"{system} Question {q + 1}: {rng.choice(_QUESTION_STARTS)} "
            prompt = fit_to_tokens(tokenizer, head + prose(rng, question_len + 8).lower() + "?", total)
            convs.append(Conversation([Turn(prompt, count_tokens(tokenizer, prompt), output_len)]))
    return convs


def multi_turn_workload(
    tokenizer: Any,
    num_conversations: int,
    num_turns: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[Conversation]:
    """Chats of `num_turns` user messages; each turn resends the conversation so far (see render_text)."""
    rng = random.Random(seed)
    convs = []
    for _ in range(num_conversations):
        ins = sample_lens(rng, num_turns, input_len, range_ratio)
        outs = sample_lens(rng, num_turns, output_len, range_ratio)
        turns = [Turn(text_of_tokens(tokenizer, i, rng), i, o) for i, o in zip(ins, outs, strict=True)]
        convs.append(Conversation(turns))
    return convs


def jsonl_workload(tokenizer: Any, path: str, num_prompts: int | None = None) -> list[Conversation]:
    """One {"prompt": str, "output_len": int} object per line."""
    convs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("output_len"), int):
                raise ValueError(f"{path}:{lineno}: need {{'prompt': str, 'output_len': int}}, got {obj}")
            prompt = obj["prompt"]
            convs.append(Conversation([Turn(prompt, count_tokens(tokenizer, prompt), obj["output_len"])]))
            if num_prompts and len(convs) >= num_prompts:
                break
    return convs


def sharegpt_workload(
    tokenizer: Any,
    path: str,
    num_prompts: int,
    seed: int,
    output_len: int | None = None,
    context_len: int | None = None,
) -> list[Conversation]:
    """SGLang's sharegpt sampling: each conversation's first two turns as prompt and reference answer, shuffled
    with the seed, keeping pairs of at least 2 tokens each (and within `context_len`); the answer's length is
    the request's output length unless `output_len` fixes it."""
    if output_len is not None and output_len < 4:
        raise ValueError("--sharegpt-output-len must be at least 4")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for item in data:
        turns = item.get("conversations", item.get("conversation", []))
        if len(turns) >= 2:
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    convs: list[Conversation] = []
    for prompt, answer in pairs:
        if len(convs) == num_prompts:
            break
        prompt_len = count_tokens(tokenizer, prompt)
        out_len = count_tokens(tokenizer, answer) if output_len is None else output_len
        if prompt_len < 2 or out_len < 2 or (context_len and prompt_len + out_len > context_len):
            continue
        convs.append(Conversation([Turn(prompt, prompt_len, out_len)]))
    return convs


def apply_chat_template(tokenizer: Any, convs: list[Conversation]) -> list[Conversation]:
    """Single-turn prompts rendered as one user message through the tokenizer's chat template (its BOS text
    removed, since the server adds BOS itself), as SGLang's --apply-chat-template does."""
    out = []
    for conv in convs:
        if len(conv.turns) != 1:
            out.append(conv)
            continue
        turn = conv.turns[0]
        messages = [{"role": "user", "content": turn.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if tokenizer.bos_token:
            text = text.replace(tokenizer.bos_token, "")
        out.append(Conversation([Turn(text, count_tokens(tokenizer, text), turn.output_len)]))
    return out


def render_text(history: list[tuple[str, str]], user: str) -> str:
    """A multi-turn conversation as one completion prompt: earlier turns, then the new user message."""
    parts = [f"User: {u}\nAssistant: {a}\n" for u, a in history]
    return "".join(parts) + f"User: {user}\nAssistant:"


def render_messages(history: list[tuple[str, str]], user: str) -> list[dict[str, str]]:
    """The same conversation as chat messages."""
    msgs: list[dict[str, str]] = []
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": user}]


def build_workload(args: Any, tokenizer: Any) -> list[Conversation]:
    """The workload named by --dataset-name, from the parsed CLI arguments (through the chat template with
    --apply-chat-template, except for the chat backend, whose server applies it)."""
    convs = _named_workload(args, tokenizer)
    chat_backend = getattr(args, "backend", "") in ("openai-chat", "sglang-oai-chat", "vllm-chat")
    if getattr(args, "apply_chat_template", False) and not chat_backend:
        return apply_chat_template(tokenizer, convs)
    return convs


def _named_workload(args: Any, tokenizer: Any) -> list[Conversation]:
    name = args.dataset_name
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
        return sharegpt_workload(
            tokenizer,
            args.dataset_path,
            args.num_prompts,
            args.seed,
            args.sharegpt_output_len,
            args.sharegpt_context_len,
        )
    if name == "random":
        return random_workload(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if name == "shared-prefix":
        return shared_prefix_workload(
            tokenizer,
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if name == "multi-turn":
        return multi_turn_workload(
            tokenizer,
            args.num_prompts,
            args.num_turns,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        return jsonl_workload(tokenizer, args.dataset_path, args.num_prompts)
    raise ValueError(f"unknown --dataset-name {name!r}")


def load_tokenizer(path: str | None) -> Any:
    """An HF tokenizer from a model dir or a .gguf file; None means Kiln's default model."""
    if path is None:
        from kiln.loader.default_model import default_model_path

        path = default_model_path()
    if path.endswith(".gguf"):
        # the conversion the server runs, kept on disk after its first run: the same token counts as the
        # server's, and no re-read of the whole GGUF vocabulary (seconds) at every bench start
        from kiln.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
