"""Guided decoding: grammars compiled in bounded worker processes, then one token mask a step per guided
sequence."""
