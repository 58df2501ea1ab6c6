"""Image folder + CSV → a streamed, columnar listing (bounded memory at 10M+ samples).

The CSV is parsed once here, at pack time; readers never see it again. What each
module does: ``walk`` lists the folder, ``csvrows`` parses the CSV, ``join`` finds
the file each row names, ``listing`` assembles the columns the converter packs,
``files`` reads one image and places its boxes, ``strings`` holds many strings in
one buffer; ``split`` makes the same listing in steps that run apart (Dask tasks).
"""

from packio.sources.csvrows import FIELDS, parse_columns
from packio.sources.files import boxes_to_stored_frame, read_image_file
from packio.sources.listing import UNLABELLED, Listing, Scan, SourceItem, scan_source
from packio.sources.walk import PATH_MAX

__all__ = ["SourceItem", "Listing", "Scan", "parse_columns", "boxes_to_stored_frame", "read_image_file",
           "scan_source", "FIELDS", "PATH_MAX", "UNLABELLED"]
