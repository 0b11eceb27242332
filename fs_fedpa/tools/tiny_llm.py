"""A tiny random causal LM and synthetic instruction data, built offline, for FS-LLM runs on a CPU.

``python -m fs_fedpa.tools.tiny_llm OUT_DIR`` writes ``OUT_DIR/model`` (a word-level tokenizer trained
on the data and a random 2-layer Llama) and ``OUT_DIR/data.jsonl`` (FS-LLM's instruction format).
``yaml_configs/fedpa_tiny_llm_cpu.yaml`` runs on them; the integration tests build the same assets.
Nothing is downloaded. Needs FederatedScope (its prompt templates shape the tokenizer).
"""

from __future__ import annotations

import inspect
import json
import random
import re
import sys
from collections.abc import Iterable
from importlib.util import find_spec
from pathlib import Path

from fs_fedpa.tools import cli

# Special tokens FS's get_tokenizer checks (llm/dataset/llm_dataset.py:DefaultToken). Defining all
# four means get_tokenizer adds none, so FS never resizes/mean-initialises the embeddings.
PAD, EOS, BOS, UNK = "[PAD]", "</s>", "<s>", "<unk>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]  # ids 0..3

# Synthetic categories: name -> words that give it away. Category 0/1 form a sentiment task.
_CATEGORY_WORDS = {
    "positive": ["good", "great", "fun", "lovely", "happy", "excellent", "bright", "warm"],
    "negative": ["bad", "awful", "boring", "sad", "terrible", "dull", "cold", "ugly"],
    "sports": ["ball", "goal", "team", "match", "coach", "score", "race", "player"],
    "food": ["bread", "soup", "rice", "apple", "cheese", "salad", "cake", "pasta"],
    "music": ["song", "guitar", "drum", "piano", "melody", "band", "tune", "choir"],
    "weather": ["rain", "snow", "wind", "storm", "sunny", "cloud", "fog", "thunder"],
    "travel": ["train", "plane", "hotel", "map", "ticket", "beach", "road", "trip"],
    "science": ["atom", "cell", "energy", "planet", "theory", "lab", "gene", "laser"],
}
_FILLER = ["the", "a", "this", "was", "very", "really", "and", "it", "so", "quite"]
_OBJECTS = ["movie", "book", "day", "story", "show", "place", "thing", "event"]
_INSTRUCTIONS = ("Classify the sentiment of the review .", "Which topic is this text about ?")
MAX_CATEGORIES = len(_CATEGORY_WORDS)


def _fs_prompt_dict() -> dict:
    """FS-LLM's own prompt templates (the tokenizer gives their literal pieces one token each)."""
    from federatedscope.llm.dataset.llm_dataset import PROMPT_DICT

    return dict(PROMPT_DICT)


def _prompt_chunks(prompt_dict: dict) -> list[str]:
    """Literal pieces of the FS prompt templates between the ``{field}`` placeholders."""
    chunks: list[str] = []
    for tmpl in prompt_dict.values():
        for piece in re.split(r"\{[a-z_]+\}", tmpl):
            if piece and piece not in chunks:
                chunks.append(piece)
    return chunks


# --------------------------------------------------------------------------------------------- #
# 1. tokenizer + model
# --------------------------------------------------------------------------------------------- #
def build_tiny_llama(
    path,
    vocab_texts: Iterable[str],
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    *,
    intermediate: int | None = None,
    max_positions: int = 256,
    compact_prompt: bool = True,
    model_max_length: int = 32,
) -> str:
    """Train a word-level tokenizer on ``vocab_texts`` and save it with a random tiny Llama at ``path``.

    * Tokenizer: ``tokenizers`` WordLevel + Whitespace pre-tokenizer (``\\w+|[^\\w\\s]+``), special
      tokens ``[PAD]``/``<unk>``/``<s>``/``</s>`` (ids 0..3), no BOS/EOS post-processor (FS appends
      ``</s>`` to the target text itself). Wrapped in ``PreTrainedTokenizerFast`` and saved.
    * ``compact_prompt`` (default): each literal chunk of FS's Alpaca prompt templates (e.g. the
      whole "Below is an instruction ... ### Instruction:\\n" preamble) becomes ONE added token, so a
      full prompt+answer fits in ``llm.tok_len: 32``. Without it the preamble alone is ~35 word
      tokens: with tok_len 32 the answer is truncated away, every label is -100 and the HF loss is
      NaN (LLMTrainer then silently skips the batch).
    * Model: ``LlamaForCausalLM(LlamaConfig(...))`` under ``torch.manual_seed(seed)``, vocab = len(tokenizer),
      untied embeddings, saved with ``save_pretrained`` (safetensors).

    Loads offline with ``AutoTokenizer.from_pretrained(path, use_fast=False, padding_side='right',
    model_max_length=...)`` and ``AutoModelForCausalLM.from_pretrained(path)``. Returns ``str(path)``.
    """
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    texts = [str(t) for t in vocab_texts]
    prompt_dict = _fs_prompt_dict()
    # Template words go into the vocabulary either way (covers compact_prompt=False).
    texts += [re.sub(r"\{[a-z_]+\}", " ", t) for t in prompt_dict.values()]

    tok = Tokenizer(models.WordLevel(vocab={}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=100_000, min_frequency=1, special_tokens=SPECIAL_TOKENS)
    tok.train_from_iterator(texts, trainer=trainer)
    if compact_prompt:
        tok.add_tokens(
            [
                AddedToken(c, single_word=False, lstrip=False, rstrip=False, normalized=False)
                for c in _prompt_chunks(prompt_dict)
            ]
        )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="right",
        model_max_length=model_max_length,
    )
    hf_tok.save_pretrained(str(path))

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


# --------------------------------------------------------------------------------------------- #
# 2. data
# --------------------------------------------------------------------------------------------- #
def make_instruction_records(n: int, seed: int = 0, num_categories: int = 2) -> list[dict]:
    """Deterministic records ``{instruction, input, output, category}``; output == category name.

    Labels are balanced (``i % K``, then shuffled) so pandas category codes are contiguous 0..K-1
    (required by FS's LDA splitter). K=2 is a sentiment task, K>2 a topic task.
    """
    if not 1 <= num_categories <= MAX_CATEGORIES:
        raise ValueError(f"num_categories must be in 1..{MAX_CATEGORIES}")
    rng = random.Random(seed)
    names = list(_CATEGORY_WORDS)[:num_categories]
    instruction = _INSTRUCTIONS[0] if num_categories <= 2 else _INSTRUCTIONS[1]
    labels = [i % num_categories for i in range(n)]
    rng.shuffle(labels)
    records = []
    for lab in labels:
        name = names[lab]
        words = rng.sample(_CATEGORY_WORDS[name], 2)
        text = " ".join([rng.choice(_FILLER), rng.choice(_OBJECTS), rng.choice(_FILLER), words[0], "and", words[1]])
        records.append({"instruction": instruction, "input": text, "output": name, "category": name})
    return records


def write_instruction_jsonl(path, n: int, seed: int = 0, num_categories: int = 2) -> tuple[str, list[str]]:
    """Write ``n`` FS-LLM jsonl lines (keys read by ``load_jsonl``: instruction/input/output/category).

    Returns ``(abs_path, texts)`` where ``texts`` is a vocabulary corpus for ``build_tiny_llama``
    covering every category (also those not sampled).
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    records = make_instruction_records(n, seed=seed, num_categories=num_categories)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    texts = [f"{r['instruction']} {r['input']} {r['output']}" for r in records]
    texts += [" ".join(ws) + " " + name for name, ws in _CATEGORY_WORDS.items()]
    texts += [" ".join(_FILLER + _OBJECTS), _INSTRUCTIONS[0], _INSTRUCTIONS[1]]
    return str(path), texts


# ------------------------------------------------------------------------- a tiny GLUE task and encoder
_SST_POS, _SST_NEG = _CATEGORY_WORDS["positive"], _CATEGORY_WORDS["negative"]


def write_tiny_glue(root, n_train: int = 120, n_dev: int = 40, seed: int = 0) -> tuple[str, list[str]]:
    """``<root>/SST-2/{train,dev}.tsv`` in GLUE's layout (header, tab-separated, trailing space after the
    sentence) with a learnable synthetic sentiment task; returns ``(root, texts)`` for a vocabulary."""
    rng = random.Random(seed)
    folder = Path(root) / "SST-2"
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        lines = ["sentence\tlabel"]
        for i in range(n):
            label = i % 2
            words = rng.sample(_SST_POS if label else _SST_NEG, 2)
            sentence = f"the {rng.choice(['movie', 'book', 'show'])} was {words[0]} and {words[1]}"
            texts.append(sentence)
            lines.append(f"{sentence} \t{label}")
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(Path(root).resolve()), texts


def build_tiny_bert(path, vocab_texts: Iterable[str], hidden: int = 32, layers: int = 2, seed: int = 0) -> str:
    """A random 2-layer BERT (saved as ``BertModel``, like MiniLM) with a word-level ``vocab.txt`` tokenizer."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for t in vocab_texts for w in t.lower().split()})
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (path / "vocab.txt").write_text("\n".join(tokens) + "\n")
    if "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters:  # transformers 5 ignores vocab_file
        tokenizer = BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)
    else:
        tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    if len(tokenizer) != len(tokens):
        raise RuntimeError(f"the tiny BERT tokenizer has {len(tokenizer)} tokens, not the {len(tokens)} written")
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=5 + len(words),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(str(path))
    return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = cli.Parser(prog="python -m fs_fedpa.tools.tiny_llm", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write model/ and data.jsonl into")
    parser.add_argument("--samples", type=cli.number(int, minimum=1), default=120, help="number of instruction records")
    parser.add_argument("--categories", type=cli.number(int, minimum=1, maximum=MAX_CATEGORIES), default=2,
                        help="2: sentiment task; 3..8: topic task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if missing := [m for m in ("federatedscope", "torch", "transformers", "tokenizers") if find_spec(m) is None]:
        parser.error(f"needs {', '.join(missing)}, which this Python lacks (FederatedScope: see docs/install.md)")
    out = Path(args.out_dir)
    if (blocked := cli.file_in_the_way(out)) is not None:
        parser.error(f"{out}: {blocked} is a file, not a folder to write model/ and data.jsonl into")
    data, texts = write_instruction_jsonl(out / "data.jsonl", args.samples, args.seed, args.categories)
    model = build_tiny_llama(out / "model", texts, seed=args.seed)
    print(f"wrote {data} and {model}")


if __name__ == "__main__":
    sys.exit(cli.one_line_errors(main, "tiny_llm")())
