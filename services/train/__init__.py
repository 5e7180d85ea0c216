"""Training a small looped model on text every Python install has (``rlt train``).

Owns the corpus and its held-out split, the BPE tokenizer, a batched trainable form of the
Ouro model, Ouro's exit-gate objectives and the export to Hugging Face's checkpoint format.
Imports the model format from ``services.worker.model`` and nothing of the serving path.
"""
