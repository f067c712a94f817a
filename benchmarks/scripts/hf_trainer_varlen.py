"""A Hugging Face `Trainer` on variable-length text with evaluation, the
run batch-size finders get wrong: most samples are short, a few are long,
batches are padded to their longest sample, and the evaluation runs every
N steps at its own batch size. A GPT-2 built from a config (no download).

    python hf_trainer_varlen.py --per_device_train_batch_size 32 --max_steps 60 \\
        --eval_steps 30 --per_device_eval_batch_size 32 --use_cpu False

Lengths: lognormal (median ~--median_len tokens) clipped to [16, --max_len],
the same for every seed; `--seed` (TrainingArguments') shuffles them.
`--n_layer`, `--n_embd`, `--vocab_size` size the model; bf16 and gradient
checkpointing are the Trainer's own `--bf16` and `--gradient_checkpointing`.
"""

import math
import os
import tempfile
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging


@dataclass
class DataArguments:
    n_layer: int = field(default=24)
    n_embd: int = field(default=1024)
    vocab_size: int = field(default=32000)
    max_len: int = field(default=1024, metadata={"help": "the longest sample"})
    median_len: int = field(default=128, metadata={"help": "the median sample"})
    train_samples: int = field(default=4096)
    eval_samples: int = field(default=512)


class VariableLengthText(Dataset):
    """Token sequences of long-tailed lengths, made once from a fixed generator."""

    def __init__(self, samples, median_len, max_len, vocab_size, seed):
        generator = torch.Generator().manual_seed(seed)
        normal = torch.randn(samples, generator=generator)
        lengths = (median_len * torch.exp(0.8 * normal)).clamp(16, max_len).long()
        self.samples = [
            torch.randint(1, vocab_size, (int(length),), generator=generator) for length in lengths
        ]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return {"input_ids": self.samples[index]}


def pad_to_longest(features):
    """A causal-LM collator: pad to the batch's longest sample, labels -100 on padding."""
    longest = max(len(feature["input_ids"]) for feature in features)
    input_ids = torch.zeros(len(features), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, feature in enumerate(features):
        tokens = feature["input_ids"]
        input_ids[row, : len(tokens)] = tokens
        attention_mask[row, : len(tokens)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main():
    hf_logging.set_verbosity_error()
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join(tempfile.gettempdir(), "oomdoc-hf-varlen"),
        max_steps=60,
        eval_strategy="steps",
        eval_steps=30,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=1e-4,
    )
    data_args, training_args = parser.parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=data_args.vocab_size,
        n_positions=data_args.max_len,
        n_embd=data_args.n_embd,
        n_layer=data_args.n_layer,
        n_head=max(1, data_args.n_embd // 64),
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    train = VariableLengthText(
        data_args.train_samples, data_args.median_len, data_args.max_len, data_args.vocab_size, 0
    )
    evaluation = VariableLengthText(
        data_args.eval_samples, data_args.median_len, data_args.max_len, data_args.vocab_size, 1
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=pad_to_longest,
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    loss = metrics.get("eval_loss")
    print(
        f"trained {result.global_step} steps, eval loss "
        f"{loss if loss is None or math.isnan(loss) else round(loss, 4)}",
        flush=True,
    )


if __name__ == "__main__":
    main()
