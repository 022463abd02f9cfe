"""Inference engines outside retrofitter that exported models run in (llama.cpp, built from source)."""
