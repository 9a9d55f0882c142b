"""The bytes of a checkpoint and their names: file formats, manifests, codecs, checksums.

Pure data and the safe reading of files; nothing here decides where a checkpoint lives.
"""
