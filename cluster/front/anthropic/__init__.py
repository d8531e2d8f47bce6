"""Anthropic's Messages API on the front: its schemas and translation to the chat request
(schemas.py), and the chat answer translated back (anthropic_format.py)."""
