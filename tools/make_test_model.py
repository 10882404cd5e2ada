#!/usr/bin/env python3
"""Write a random-weight GGUF test model; the implementation is fomoepy.devtools.make_test_model.

python tools/make_test_model.py OUT.gguf --preset tiny-qwen3moe-q4km [--seed S] [--n-embd N] ...
"""

from fomoepy.devtools.make_test_model import main

if __name__ == "__main__":
    raise SystemExit(main())
