"""The covering runs of tests/integration/test_coverage.py: real training jobs that together set every
field of every schema and choose every option of every group. Other test modules name a
covering run (``RUNS[name]`` through the ``placeholders`` fixture) to share its job
instead of running one of their own."""

from __future__ import annotations

from tests.helpers import data_files

GPT = ["model=gpt", "model.n_layers=1", "model.mlp_ratio=2", "data.seed=3", "data.branching=2"]
WANDB = ["logger=wandb", "logger.mode=offline", "logger.project=coverage", "logger.entity=sharded-exp-tests",
         "logger.group=covering", "logger.job_type=check", "logger.run_name=covering-ddp", "logger.tags=[a,b]",
         "logger.init_timeout_s=30"]  # fmt: skip

ENV = {"ddp": {"SHARDED_EXP_FAULT": "rank=1,step=1,kind=inf_grad"}}
"""The environment of a covering run (a testing aid)."""
RUNS = {
    # DDP's knobs, AdamW's (foreach kernels on CPU), float16's loss scaling, and the trainer's
    # odds and ends (gradients zeroed, not freed, between steps; the mmap threshold fixed). The inf
    # at step 1 (rank 1's gradient) is skipped and backs the scale off by 0.25; three clean
    # steps double it: 1024 -> 256 -> 512 after 6 steps.
    "ddp": [
        "strategy=ddp", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "strategy.find_unused_parameters=true",
        "strategy.broadcast_buffers=false", "optimizer=adamw", "optimizer.lr=5e-3", "optimizer.weight_decay=0.01",
        "optimizer.no_decay_lr_scale=0.5", "optimizer.betas=[0.8,0.99]", "optimizer.eps=1e-7", "optimizer.foreach=true",
        "trainer.zero_grad=zeros", "precision=16",
        "precision.init_scale=1024", "precision.growth_interval=3", "precision.backoff_factor=0.25",
        "trainer.seed=1", "trainer.grad_clip=0.5", "trainer.memory_limit_mib=1000", "trainer.stop_grace_s=30",
        "trainer.accelerator=cpu", "trainer.progress_bar=true", "model.in_features=32", "model.num_classes=5",
        "data.seed=7", "data.teacher_hidden=16", "trainer.profile=true", "trainer.profile_steps=2",
        "trainer.memory_snapshot=always", "trainer.host_mmap_threshold=fixed", *WANDB,
    ],
    # OSS's knobs, SGD with momentum, the GPT's shape, bf16, three ranks.
    "oss": [
        "strategy=oss", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "trainer.activation_checkpointing=selective", "trainer.ac_every=2",
        "strategy.broadcast_buffers=false", "strategy.broadcast_fp16=true", "strategy.find_unused_parameters=true",
        "optimizer=sgd", "optimizer.lr=0.05",
        "optimizer.momentum=0.9", *GPT, "precision=bf16", "trainer.world_size=3",
    ],
    # The same run compiled (slow tier: a cold compile is about 16 s of a clean machine's
    # default tier; test_levers.py compiles every strategy there too).
    "oss_compiled": [
        "strategy=oss", "trainer.activation_checkpointing=selective", "trainer.ac_every=2", "trainer.compile=true",
        "trainer.compile_mode=reduce_overhead", "trainer.timeout_s=300",  # a cold compile may be slow on one rank
        "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9", *GPT, "precision=bf16", "trainer.world_size=3",
    ],
    # ShardedDDP without reduce buckets, BERT token classification (eager attention) on a CoNLL
    # file (made by the test) through the DataLoader with a worker per rank, accumulation, evaluation.
    "sharded_ddp": [
        "strategy=sharded_ddp", "strategy.reduce_buffer_size=0", "strategy.broadcast_buffers=false",
        "strategy.broadcast_fp16=true", "model=hf_bert", "model.seq_len=16", "model.attn_implementation=eager",
        "trainer.batch_size=4",
        "optimizer.lr=3e-3", "trainer.grad_accum=2", "trainer.eval_every=2",
        "trainer.eval_batches=2", "trainer.log_interval=3", "trainer.steps=8",
        "data=conll", "data.path=__data__train.conll", "paths.data_dir=__data__tok", "data.tokenizer=${paths.data_dir}", "data.seed=3",
        "data.shuffle=false", "data.num_workers=1", "data.labels=[O,B-MISC,I-MISC,B-PER,I-PER,B-ORG,I-ORG,B-LOC,I-LOC]",
    ],
    # ZeRO-1's knobs, GPT-2 (causal LM), consolidated checkpoints of which one is kept.
    "zero1": [
        "strategy=zero1", "strategy.bucket_cap_mb=1", "strategy.gradient_as_bucket_view=true",
        "strategy.broadcast_buffers=false", "strategy.parameters_as_bucket_view=true",
        "strategy.find_unused_parameters=true", "model=hf_gpt2",
        "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data.seed=9", "data.branching=2",
        "trainer.checkpoint_every=2", "trainer.checkpoint_format=consolidated", "trainer.keep_checkpoints=1",
        "trainer.save_final_state=true", "trainer.checkpoint_dir=__tmp__zero1_ckpt",
    ],
    # FSDP keeping gathered parameters (ZeRO-2-like), Llama, asynchronous DCP checkpoints,
    # a frozen embedding, a longer warm-up.
    "fsdp": [
        "strategy=fsdp", "strategy.reshard_after_forward=false", "strategy.broadcast_buffers=false", "model=hf_llama", "model.seq_len=16",
        "strategy.replicate=2", "strategy.param_dtype=float32", "strategy.reduce_dtype=bfloat16",
        "trainer.activation_checkpointing=full",
        "trainer.batch_size=4", "optimizer.lr=3e-3", "trainer.checkpoint_every=3", "trainer.checkpoint_format=dcp",
        "trainer.checkpoint_async=true", "trainer.warmup_steps=2", "trainer.min_timed_steps=4", "trainer.freeze=[model.embed_tokens.*]",
        "trainer.timeout_s=90",
    ],
    # FSDP resharding after forward (ZeRO-3) on your own model: 4 steps with checkpoints ...
    "fsdp_grad_op": [
        "strategy=fsdp_grad_op", "strategy.reshard_after_forward=true", "strategy.broadcast_buffers=false",
        "strategy.replicate=2", "strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32",
        "model=custom", "model._target_=tests.helpers.user_models.build", "+model.hidden=24", "optimizer.lr=1e-2", "trainer.steps=4",
        "trainer.checkpoint_every=2", "trainer.checkpoint_dir=__tmp__grad_op_ckpt", "trainer.host_memory_check=false",
    ],
    # Your data, beyond the CoNLL file (the sharded_ddp run's): plain text for GPT-2, in file order ...
    "text_file": [
        "model=hf_gpt2", "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data=text_file",
        "data.path=__data__corpus.jsonl", "data.text_field=body", "data.tokenizer=__data__tok", "data.seed=2",
        "data.shuffle=false", "data.num_workers=1",
    ],
    # ... a saved datasets dataset's validation split of words and tag names ...
    "hf_dataset_ner": [
        "model=hf_bert", "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data=hf_dataset",
        "data.path=__data__ner_dataset", "data.split=validation", "data.kind=token_classification",
        "data.tokens_field=words", "data.labels_field=tags", "data.tokenizer=__data__tok", "data.seed=4",
        "data.shuffle=false", "data.num_workers=1", "data.labels=[O,B-PER,I-PER,B-ORG,I-ORG,B-LOC,I-LOC,B-MISC,I-MISC,X]",
        "model.num_labels=10",
    ],
    # ... JSON lines through load_dataset ...
    "hf_dataset_json": [
        "model=hf_gpt2", "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data=hf_dataset",
        "data.format=json", "data.path=__data__corpus.jsonl", "data.text_field=body", "data.tokenizer=__data__tok",
    ],
    # ... and your own Datasets: a classifier's (default_collate) and a causal LM's (its collate_fn).
    "custom_classes": [
        "data=custom", "data._target_=tests.helpers.data_files.Classes", "+data.kwargs.n=256", "+data.kwargs.in_features=32",
        "+data.kwargs.classes=5", "data.metric=accuracy", "data.labels=targets", "data.num_classes=5",
        "data.seed=5", "data.shuffle=false", "model.in_features=32", "model.num_classes=5",
        "optimizer.lr=1e-2",
    ],
    "custom_lm": [
        "model=hf_gpt2", "model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3", "data=custom",
        "data._target_=tests.helpers.data_files.Counting", "+data.kwargs.n=64", "+data.kwargs.seq_len=16",
        "+data.kwargs.vocab=64", "data.shift_labels=true", "data.metric=perplexity", "model.vocab_size=64",
        "data.num_workers=1",
    ],
    # ... then resumed (resume=auto) to step 8 from the newest of them.
    "fsdp_grad_op_resumed": [
        "strategy=fsdp_grad_op", "strategy.reshard_after_forward=true", "model=custom",
        "model._target_=tests.helpers.user_models.build", "+model.hidden=24", "optimizer.lr=1e-2", "trainer.steps=8",
        "trainer.checkpoint_every=2", "trainer.checkpoint_dir=__tmp__grad_op_ckpt", "trainer.resume=auto",
        "trainer.existing_checkpoints=archive",
    ],
    # Your weights: FSDP from a directory save_pretrained wrote (rank 0 loads, each rank keeps
    # its shard); step 0's loss is the saved model's (tests/integration/test_pretrained.py).
    "pretrained": [
        "strategy=fsdp", "model=hf_gpt2", "model.pretrained=__saved__gpt2", "model.seq_len=16", "precision=fp32",
        "trainer.batch_size=4", "trainer.log_interval=1", "optimizer.lr=3e-3",
    ],
}  # fmt: skip
"""Training runs (``tiny`` adds the small shapes): one per strategy, each setting its knobs,
and one per data option of a user's data. ``__tmp__NAME``: a directory of this session;
``__data__NAME``: a file made by tests/helpers/data_files.py (:data:`DATA_FILES`)."""

DATA_FILES = {
    "train.conll": data_files.write_conll,
    "corpus.jsonl": data_files.write_jsonl,
    "tok": data_files.train_tokenizer,
    "ner_dataset": data_files.save_ner_dataset,
}
"""The files a covering run's ``__data__NAME`` names, and what makes each."""
