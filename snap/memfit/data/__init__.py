"""Offline text data: a corpus built from Python's own documentation, and a byte tokenizer."""
from memfit.data.corpus import build_corpus, corpus_documents, dev_test_split, token_splits
from memfit.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "build_corpus", "corpus_documents", "dev_test_split", "token_splits"]
