"""Load an fs_fedpa export with plain PEFT: the global adapter plus one client's head, i.e. that client's model under
the paper protocol, and print its SST-2 dev accuracy on the client's dev examples beside the one the run logged.

    python docs/load_export.py --export exp/export --run <the run's FS output folder> --data <GLUE dir> --client 1

The run must have written ``fedpa_eval_shards.json`` and ``fedpa_outcomes.jsonl``
(``fedpa.records.save_outcomes True``; the
main job ``./run.sh`` does), which say which dev sentences are the client's and what the run got right on each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from fs_fedpa.tasks.glue import default_eval_split, load_glue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, type=Path)
    parser.add_argument("--run", required=True, type=Path, help="the run's FS output folder")
    parser.add_argument("--data", required=True, help="the GLUE folder the run read")
    parser.add_argument("--client", type=int, default=1)
    args = parser.parse_args()
    info = json.loads((args.export / "export.json").read_text())

    # The three lines: base model, the global adapter, the client's head.
    base = AutoModelForSequenceClassification.from_pretrained(info["base_model"], num_labels=info["num_labels"])
    model = PeftModel.from_pretrained(base, str(args.export / "global"))
    model.load_state_dict(load_file(str(args.export / "heads" / f"client_{args.client}.safetensors")), strict=False)
    model.eval()

    # The client's dev sentences, as the run split them, tokenized as the run did.
    shard = json.loads((args.run / "fedpa_eval_shards.json").read_text())["splits"]["val"][str(args.client)]
    dev = load_glue("sst2", args.data, default_eval_split("sst2"))
    tok_len = yaml.safe_load((args.run / "config.yaml").read_text())["llm"]["tok_len"]
    tokenizer = AutoTokenizer.from_pretrained(info["base_model"])
    correct = []
    with torch.no_grad():
        for start in range(0, len(shard), 64):
            rows = [dev[i] for i in shard[start : start + 64]]
            enc = tokenizer([r.text_a for r in rows], truncation=True, max_length=tok_len, padding=True,
                            return_tensors="pt")  # fmt: skip
            guess = model(**enc).logits.argmax(-1)
            correct += (guess == torch.tensor([r.label for r in rows])).tolist()

    lines = [json.loads(line) for line in (args.run / "fedpa_outcomes.jsonl").read_text().splitlines()]
    mine = [x for x in lines if x["client"] == args.client and x["protocol"] == "global" and x["split"] == "val"]
    logged = max(mine, key=lambda x: x["round"])
    bits = [c == "1" for c in logged["correct"]]
    print(f"client {args.client}: {len(shard)} dev sentences")
    print(f"  accuracy of the exported global adapter + its head: {sum(correct) / len(correct):.4f}")
    print(f"  accuracy the run logged (paper protocol, round {logged['round']}): {sum(bits) / len(bits):.4f}")
    agree = sum(a == b for a, b in zip(correct, bits))
    print(f"  predictions that agree with the run's, sentence by sentence: {agree}/{len(bits)}")


if __name__ == "__main__":
    main()
