"""Draft models: the EAGLE-3 head (:mod:`ssd_eagle.models.eagle3`) and its checkpoint formats
(:mod:`ssd_eagle.models.eagle3_formats`)."""
