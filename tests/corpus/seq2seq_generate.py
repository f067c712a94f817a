"""A summarization fine-tune in the idiom of transformers'
examples/pytorch/summarization/run_summarization.py: `HfArgumentParser` over
model, data and `Seq2SeqTrainingArguments`, a T5 built from a config (no
download), `Seq2SeqTrainer` with `predict_with_generate`, so every
evaluation runs `model.generate()` with beam search at the evaluation batch.

    python seq2seq_generate.py --per_device_train_batch_size 16 \\
        --per_device_eval_batch_size 64 --generation_num_beams 4

What makes it a real-idiom script rather than one shaped for oomdoc:
- `Seq2SeqTrainer`, the entry point shipped in transformers, evaluating
  every `--eval_steps` with `generate()` (`--generation_max_length`,
  `--generation_num_beams`): beam search multiplies the evaluation batch
  by the beams, so a run whose training fits runs out of memory in its
  first evaluation;
- a `compute_metrics` over the generated ids (exact-token overlap with the
  labels, standing in for ROUGE), labels padded with -100 as
  `DataCollatorForSeq2Seq` pads them, and the `-100 -> pad` swap before
  decoding that every summarization script does;
- source and target lengths long-tailed, padded to each batch's longest.

Defaults fit the simulated device (`oomdoc run --device cpu --device-memory
48MiB`): T5 with d_model 64, 2 + 2 layers, vocabulary 2000; 256 training and
64 validation samples; 1 epoch; evaluation every 8 steps. Run it with
OMP_NUM_THREADS=1 on a shared CPU.
"""

import os
import tempfile
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset
from transformers import (
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.utils import logging as hf_logging

PAD = 0
EOS = 1


@dataclass
class ModelArguments:
    d_model: int = field(default=64)
    num_layers: int = field(default=2)
    num_heads: int = field(default=4)
    vocab_size: int = field(default=2000)


@dataclass
class DataTrainingArguments:
    train_samples: int = field(default=256)
    eval_samples: int = field(default=64)
    max_source_length: int = field(default=192)
    max_target_length: int = field(default=48)


class Articles(Dataset):
    """(article, summary) token ids of long-tailed lengths, made once from a
    fixed generator; the summary is drawn from the article so there is
    something to learn."""

    def __init__(self, samples, max_source, max_target, vocab_size, seed):
        generator = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(samples):
            source = int(
                (48 * torch.exp(0.6 * torch.randn(1, generator=generator))).clamp(8, max_source)
            )
            target = max(4, min(max_target, source // 4))
            article = torch.randint(2, vocab_size, (source,), generator=generator)
            summary = article[torch.randperm(source, generator=generator)[:target]].sort().values
            self.items.append(
                (
                    torch.cat([article, torch.tensor([EOS])]),
                    torch.cat([summary, torch.tensor([EOS])]),
                )
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        article, summary = self.items[index]
        return {"input_ids": article, "labels": summary}


def collate(features):
    """What DataCollatorForSeq2Seq does with padding="longest": inputs padded
    with the pad id, labels with -100."""
    source = max(len(f["input_ids"]) for f in features)
    target = max(len(f["labels"]) for f in features)
    input_ids = torch.full((len(features), source), PAD, dtype=torch.long)
    labels = torch.full((len(features), target), -100, dtype=torch.long)
    for row, feature in enumerate(features):
        input_ids[row, : len(feature["input_ids"])] = feature["input_ids"]
        labels[row, : len(feature["labels"])] = feature["labels"]
    return {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(), "labels": labels}


def compute_metrics(eval_preds):
    predictions, labels = eval_preds
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    labels = labels.copy()
    labels[labels == -100] = PAD
    overlaps = []
    for predicted, reference in zip(predictions, labels):
        predicted = {int(t) for t in predicted if t > EOS}
        reference = {int(t) for t in reference if t > EOS}
        overlaps.append(len(predicted & reference) / max(1, len(reference)))
    return {"token_overlap": sum(overlaps) / max(1, len(overlaps))}


def main():
    hf_logging.set_verbosity_error()
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join(tempfile.gettempdir(), "oomdoc-seq2seq"),
        num_train_epochs=1,
        eval_strategy="steps",
        eval_steps=8,
        predict_with_generate=True,
        generation_max_length=48,
        generation_num_beams=4,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=3e-4,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    torch.manual_seed(training_args.seed)
    config = T5Config(
        vocab_size=model_args.vocab_size,
        d_model=model_args.d_model,
        d_kv=model_args.d_model // model_args.num_heads,
        d_ff=4 * model_args.d_model,
        num_layers=model_args.num_layers,
        num_decoder_layers=model_args.num_layers,
        num_heads=model_args.num_heads,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    model = T5ForConditionalGeneration(config)
    train = Articles(
        data_args.train_samples,
        data_args.max_source_length,
        data_args.max_target_length,
        model_args.vocab_size,
        0,
    )
    evaluation = Articles(
        data_args.eval_samples,
        data_args.max_source_length,
        data_args.max_target_length,
        model_args.vocab_size,
        1,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate,
        compute_metrics=compute_metrics,
    )
    result = trainer.train()
    metrics = trainer.evaluate(metric_key_prefix="eval")
    print(
        f"trained {result.global_step} steps, eval loss {metrics['eval_loss']:.4f}, "
        f"token overlap {metrics['eval_token_overlap']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
