"""Example tasks that ship with ray-elastic (used by ``ray-elastic demo`` and ``train``).

``digits_mlp``: an MLP on scikit-learn's bundled 8x8 digits.
``char_transformer``: a small decoder-only transformer trained character-level on
the Python standard library's own source files (no download).
``llm``: a decoder LLM of today's shape (RMSNorm, rotary, SwiGLU, grouped-query attention),
annotated for ``fsdp`` x ``tensor``, with eval on held-out files and metrics.
"""

EXAMPLES = {
    "mlp": "ray_elastic.examples.digits_mlp:DigitsMLPTask",
    "transformer": "ray_elastic.examples.char_transformer:CharTransformerTask",
    "llm": "ray_elastic.examples.llm:DecoderLMTask",
}

# ``ElasticConfig`` settings an example runs with from the command line unless a flag says otherwise.
EXAMPLE_SETTINGS = {
    "llm": {
        "slice_mesh": {"fsdp": -1, "tensor": 2},
        "logical_axis_rules": "ray_elastic.examples.llm:LOGICAL_AXIS_RULES",
        "eval_every": 50,
        "eval_steps": 4,
        "progress_metrics": ("accuracy", "eval/loss"),
    },
}
