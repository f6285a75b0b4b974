"""The model: load or build it and its tokenizer (sources.py: hub, local folder, packaged, GGUF, scratch; the
packaged names' packages: packaged.py; a scratch model's tokenizer: scratch_tokenizer.py), LoRA adapters
(adapters.py), the precision a run computes in (precision.py), its training losses (objectives.py), what it calls
its key/value cache (kv_cache.py), and a trained model's folder: save, read back, qatune.json (folder.py)."""
