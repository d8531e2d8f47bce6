"""A prompt's text to token ids, for whichever process holds the tokenizer: the engine
replica (every request, with one replica) or the front (with several, so that its router
can score replicas on the prompt's block hashes and the replica gets ids).

    tokenizer_pool.py   tokenize and render the chat template off the calling loop
    chat_template.py    what the template sees of a conversation's tools, and
                        chat_template_kwargs fitted to the template's variables
    reasoning.py        a reasoning model's thinking told apart from its answer
                        (--reasoning-parser; the front splits the text, the engine
                        holds structured outputs back until the thinking ends)

Imports: nothing of cluster/ but itself (transformers' tokenizer objects come in as values).
"""
