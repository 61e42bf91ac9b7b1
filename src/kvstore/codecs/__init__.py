"""KV codecs: the codecs themselves, their native decoders, and the rule that picks a tier's codec.
"""
