"""Building blocks of the decoder models: parallel linears, norms, RoPE, attention."""
