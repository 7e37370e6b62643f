"""Speculative-decoding evaluation of exported drafters: τ, acceptance per position, speed, losslessness."""
