"""The persistent task-vector bank: a directory of ``manifest.json`` + one safetensors file per vector."""
