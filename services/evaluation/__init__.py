"""What a trained looped model's depth buys (``rlt eval``): held-out loss and accuracy per
fixed depth, the exit-threshold curve, how often an early loop's greedy token is the final
one, and token-sparse prefill's cost.

Reads a checkpoint and its ``training.json`` (to rebuild the held-out split), runs the
trainable model for teacher-forced passes and the serial oracle for anything that depends
on serving semantics (exits, KV copies, sparse prefill). Imports no service's internals.
"""
