"""The dtypes a weight store's experts may be held in, by name: no torch, so the CLI's --help reads them."""

DTYPES = ("float32", "bfloat16", "float16")  # `moeless model export --dtype`; a store's index.json "dtype"
