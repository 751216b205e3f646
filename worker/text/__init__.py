"""Text in and out of the model: tokenizer, chat template, and the model files they are read from. Light: no
torch; other Switchyard packages may import it.
"""
