"""Overrides (and source) of the models and runs that several test modules share."""

from __future__ import annotations

from tests.helpers.jobs import ROOT

# Eight blocks whose parameters outweigh the activations, as in the models sharding is for.
DEEP = ["model=gpt", "model.d_model=128", "model.n_heads=4", "model.n_layers=8", "model.seq_len=8",
        "model.vocab_size=64", "trainer.batch_size=2"]  # fmt: skip

# A model with a 0-dim parameter (tests/helpers/user_models.py), trained with accumulation.
SCALAR = ["model=custom", "model._target_=tests.helpers.user_models.build_with_scalar", "trainer.grad_accum=2",
          "trainer.save_final_state=true", "optimizer.lr=1e-2", "trainer.steps=4"]  # fmt: skip

# The Hugging Face shapes of the matrix and parity runs (tests/integration/test_matrix.py).
HF = ["model.seq_len=16", "trainer.batch_size=4", "optimizer.lr=3e-3"]
STEPS = ["trainer.steps=8", "trainer.log_interval=2"]

# The parity runs (every strategy against DDP) of tests/integration/test_matrix.py, whose references
# tests/integration/test_levers.py shares.
PARITY = ["trainer.grad_accum=2", "precision=32", "trainer.save_final_state=true", "optimizer.no_decay_lr_scale=0.5"]
PARITY_MODELS = {
    "gpt": ["model=gpt", "optimizer=adam", "trainer.freeze=[pos_emb.*]", *STEPS],
    "hf_bert": ["model=hf_bert", *HF, "optimizer=sgd", "optimizer.momentum=0.9", "trainer.freeze=[bert.embeddings.*]",
                "trainer.steps=6"],
}  # fmt: skip

# The source of tests/helpers/user_models.py: a model module of a user's own.
CUSTOM = (ROOT / "tests" / "helpers" / "user_models.py").read_text()
"""The same models, copied out of the repository by the ``user_module`` fixture."""
