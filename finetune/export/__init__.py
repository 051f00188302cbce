"""From a run to a file other tools load: the GGUF writer (gguf.py, gguf_vocab.py) and the Ollama Modelfile
(modelfile.py), written into an export folder by files.py; docs/export.md."""
