"""KV codecs: the codecs themselves and their native decoders (which codec a tier uses is
:mod:`kvstore.tiers.codecs`).
"""
