"""Example tasks that ship with ray-elastic (used by ``ray-elastic demo`` and ``train``).

``digits_mlp``: an MLP on scikit-learn's bundled 8x8 digits.
``char_transformer``: a small decoder-only transformer trained character-level on
the Python standard library's own source files (no download).
"""

EXAMPLES = {
    "mlp": "ray_elastic.examples.digits_mlp:DigitsMLPTask",
    "transformer": "ray_elastic.examples.char_transformer:CharTransformerTask",
}
