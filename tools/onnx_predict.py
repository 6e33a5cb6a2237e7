"""Deployment without the training stack: masks from an export (model.json + model.onnx) with numpy,
OpenCV and onnxruntime alone; no torch, no train_unet.py. An example to port to another language or
runtime: every number comes from the sidecar. tests/test_export.py checks that its masks equal
`train_unet.py predict backend=onnxruntime`'s.

    python tools/onnx_predict.py model.json photos/ masks/     # or a single image instead of photos/

Covers fit-mode models (data_mode=fit) and what the sidecar's "preprocessing" says for 8-bit, wider
integer and float images, as OpenCV reads them (a MinIsWhite TIFF as shown, 0 black, as train_unet.py
reads it; OpenCV inverts only an 8-bit one; a colour TIFF for a grey model made grey after scaling, as
there): a file it cannot read (a multi-page TIFF stack, a TIFF layout it refuses or misreads, a JPEG cut
short or damaged) is skipped and named, the others are predicted, and the exit status is 1. For those
files, and for patch-mode models (the sliding window), use
`python train_unet.py predict backend=onnxruntime checkpoint=model.onnx`.

The .onnx must be the one export wrote beside the sidecar (its SHA-256): another export's, or one cut short
in a copy, is refused. A sidecar whose run validated with tta= gets a note: this tool predicts without it.

Masks are marked PNGs, as predict's: a rerun replaces its own earlier masks (and predict's), but a file of
a mask's name that neither wrote (a ground-truth mask), predict's overlay of an image (its mask replaced,
the folder would hold two runs' results for it), or an output folder holding the images, is refused
before anything is written; a mask that cannot be written is named, as an unreadable image is.
"""
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import cv2
import numpy as np

try:
    import onnxruntime as ort
except ImportError:
    raise SystemExit("error: onnxruntime not installed (this tool runs the export with it): pip install "
                     "onnxruntime") from None

# OpenCV's own '[ERROR:0@0.6] ... Assertion failed' line came before the one this tool says of the file
if hasattr(getattr(cv2, "utils", None), "logging"):
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_FATAL)

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")


def model_input(image, meta):
    """An image as read (HxW or HxWx3 RGB, any depth) -> (1xCxSxS float32 input, the image's area rh, rw)."""
    pre, size = meta["preprocessing"], meta["config"]["image_size"]
    rule = pre["to_unit_range"]
    if image.dtype != np.uint8:  # wider integers and floats go to [0, 1] first, uint8 after the resize
        low, high = (rule["wider integers"] if isinstance(rule["wider integers"], list) else
                     (np.iinfo(image.dtype).min, np.iinfo(image.dtype).max)) \
            if np.issubdtype(image.dtype, np.integer) else (image.min(), image.max())
        image = (image.astype(np.float32) - np.float32(low)) / np.float32(high - low) if high > low else \
            np.zeros(image.shape, np.float32)
    if image.ndim == 3 and meta["config"]["in_channels"] == 1:  # a wider colour TIFF (read), grey once scaled
        image = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    h, w = image.shape[:2]
    rh, rw = max(1, round(h * size / max(h, w))), max(1, round(w * size / max(h, w)))  # longest side to size
    x = np.zeros((size, size) + image.shape[2:], np.float32)                             # pad bottom/right with 0
    x[:rh, :rw] = cv2.resize(image, (rw, rh), interpolation=cv2.INTER_LINEAR)
    if image.dtype == np.uint8:
        x = (x - rule["uint8"][0]) / (rule["uint8"][1] - rule["uint8"][0])
    x = (x - np.float32(pre["normalize"]["mean"])) / np.float32(pre["normalize"]["std"])
    return (x[None, None] if x.ndim == 2 else x.transpose(2, 0, 1)[None]).astype(np.float32), (rh, rw)


def read(path, gray):
    """The image as the model takes it (HxW, or HxWx3 RGB), or a ValueError saying why it cannot be. For a grey
    model, a colour TIFF is made grey as train_unet.py does (it reads TIFFs with tifffile): an 8-bit one here,
    a wider or float one by model_input, after scaling. OpenCV's own grey of a signed 16-bit RGB TIFF had
    wrapped around (-29905 to 27464), and a float one's min/max was the grey's, not its colours': 0.56% of a
    mask unlike predict's, unsaid. Other files (and palette or CMYK TIFFs) OpenCV makes grey, as there."""
    if path.suffix.lower() in (".tif", ".tiff") and cv2.imcount(str(path)) > 1:
        raise ValueError("a multi-page TIFF: OpenCV would read its first page only")
    tiff = path.suffix.lower() in (".tif", ".tiff")
    tags = tiff_tags(path) if tiff else {}  # the first directory's, read once
    check_planes(tags)
    as_stored = tiff and tags.get(262) not in (3, 5)  # as tifffile reads it (palette and CMYK: OpenCV's colours)
    flip = turn_undone(tags) if as_stored else None
    colour_tiff = gray and as_stored
    try:
        image = imread_watched(path, cv2.IMREAD_ANYDEPTH | (cv2.IMREAD_ANYCOLOR if colour_tiff else
                                                           cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR))
    except cv2.error as exc:
        raise ValueError(str(exc).strip().splitlines()[-1]) from None
    if image is None:
        raise ValueError(f"OpenCV cannot read it as a {'grey' if gray else 'colour'} image (damaged, or a layout it "
                         f"refuses, such as a float TIFF of another number of channels): {FULL_READER}")
    if image.dtype == np.uint8:
        check_depth_kept(tags)
    if flip is not None:
        image = cv2.flip(image, flip)
    if image.dtype.kind == "u" and image.dtype != np.uint8 and tags.get(262) == 0:  # MinIsWhite
        image = np.iinfo(image.dtype).max - image  # as shown; OpenCV inverts an 8-bit one itself
    if image.ndim == 2:
        return image
    # BGR to RGB by reversing the channels: cv2.cvtColor refuses signed 16-bit and float64 images
    image = np.ascontiguousarray(image[..., ::-1])
    return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY) if gray and image.dtype == np.uint8 else image


# What libjpeg prints of damaged data (a file cut short, a flipped bit), which it decodes all the same into
# made-up pixels; and its warning of filler before the end marker, which some cameras write (the pixels exact)
JPEG_DAMAGE = re.compile(rb"Corrupt JPEG data: [^\r\n]*|Premature end of JPEG file")
JPEG_DAMAGE_LINE = re.compile(rb"(?:" + JPEG_DAMAGE.pattern + rb")\r?\n?")
JPEG_FILLER = re.compile(rb"Corrupt JPEG data: (\d+) extraneous bytes before marker 0xd9")


def imread_watched(path, flags):
    """cv2.imread; for a JPEG, with what libjpeg says caught from fd 2 (this tool reads one file at a time): a
    ValueError where it found the data damaged. A JPEG cut short (a partial copy) got a mask of made-up pixels
    and a 'Premature end of JPEG file' line that named no file. Anything else said there is passed on."""
    with open(path, "rb") as f:
        if f.read(2) != b"\xff\xd8":
            return cv2.imread(str(path), flags)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            image = cv2.imread(str(path), flags)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        said = caught.read()
    rest = JPEG_DAMAGE_LINE.sub(b"", said)
    if rest:
        os.write(2, rest)
    warnings = [m[0] for m in JPEG_DAMAGE.finditer(said)]
    data = path.read_bytes() if warnings else b""  # the filler check's bytes, read once
    damage = [warning for warning in warnings if not jpeg_filler(warning, data)]
    if damage:
        raise ValueError(f"a damaged JPEG: libjpeg says '{damage[0].decode('latin-1')}' and fills what it cannot "
                         f"read with made-up pixels: replace it with an intact copy")
    return image


def jpeg_filler(message, data):
    """Whether libjpeg's warning is of N bytes before the end marker that are all 0x00 or all 0xFF: filler, the
    image whole. The end marker: the first FF D9 after the first scan begins, the segments before it stepped
    over by their lengths (an EXIF thumbnail's markers are inside them); as train_unet.py's jpeg_end."""
    found, i = JPEG_FILLER.fullmatch(message), 2
    while found and i + 4 <= len(data) and data[i] == 0xFF and data[i + 1] != 0xDA:
        marker = data[i + 1]
        i += 1 if marker == 0xFF else 2 if 0xD0 <= marker <= 0xD9 or marker == 0x01 else \
            2 + int.from_bytes(data[i + 2:i + 4], "big")
    end = data.find(b"\xff\xd9", i) if found and data[i + 1:i + 2] == b"\xda" else -1
    filler = data[end - int(found[1]):end] if end > 0 else b""
    return bool(filler) and len(filler) == int(found[1]) and len(set(filler)) == 1 and filler[:1] in (b"\x00", b"\xff")


def turn_undone(tags):
    """The cv2.flip code that undoes the turn OpenCV gives a TIFF by its Orientation tag, whatever the flags
    (train_unet.py reads TIFFs as stored: a mirrored one's mask was mirrored, unsaid), or None; a ValueError
    for those turned by 90 degrees (OpenCV 5.1 cannot read them, 4.8 reads them turned) and for a tiled one
    turned at all (OpenCV 5.1 mirrors an 8-bit one's tiles one by one: no flip of the whole undoes it)."""
    orientation = tags.get(274)
    if orientation in (5, 6, 7, 8):
        raise ValueError(f"OpenCV reads a TIFF whose Orientation tag turns it by 90 degrees ({orientation}) turned, "
                         f"or not at all: {FULL_READER}")
    if orientation in (2, 3, 4) and 322 in tags:  # TileWidth: a tiled TIFF
        raise ValueError(f"OpenCV reads a tiled TIFF whose Orientation tag ({orientation}) mirrors or turns it tile "
                         f"by tile: {FULL_READER}")
    return {2: 1, 3: -1, 4: 0}.get(orientation)  # mirrored left-right, turned 180 degrees, mirrored top-bottom


def check_planes(tags):
    """A ValueError for a TIFF whose channels are stored plane by plane (PlanarConfiguration 2) that OpenCV
    misreads: all but 8-bit RGB (a 16-bit RGB one came out as other pixels' values, an RGBA one too; its mask
    unlike predict's, unsaid). By the file's tags: samples per pixel and bits per sample."""
    samples = tags.get(277) or 1
    if tags.get(284) == 2 and samples > 1 and (samples, tags.get(258)) != (3, 8):
        raise ValueError(f"OpenCV misreads its {samples} channels stored as separate planes (PlanarConfiguration 2) "
                         f"but for 8-bit RGB: {FULL_READER}")


def check_depth_kept(tags):
    """A ValueError for a TIFF whose wider samples OpenCV cut to 8 bits as it read it (a 16-bit grey-and-alpha
    TIFF, even read unchanged): scaled by the 8-bit rule, not the sidecar's range, its mask differed from
    predict's in 13% of pixels, unsaid. By the file's BitsPerSample, for TIFFs read as 8-bit only."""
    bits = tags.get(258)
    if bits is not None and bits > 8:
        raise ValueError(f"OpenCV cuts its {bits}-bit samples to 8 bits as it reads them (a TIFF of grey and alpha?): "
                         f"{FULL_READER}")


FULL_READER = "train_unet.py predict backend=onnxruntime checkpoint=model.onnx reads it"


# The tags read of a TIFF's first directory: BitsPerSample, PhotometricInterpretation (0 MinIsWhite: OpenCV
# returns a 16-bit one's stored values, where viewers and train_unet.py show it inverted), Orientation,
# SamplesPerPixel, PlanarConfiguration, TileWidth
TIFF_TAGS = (258, 262, 274, 277, 284, 322)


def tiff_tags(path):
    """{tag: its first value, read as a SHORT} of TIFF_TAGS in a TIFF's first directory (TIFF or BigTIFF); those
    before the end of a file cut short (OpenCV then says it cannot read it), none of a file that is not a TIFF.
    Read here with struct, no TIFF library needed."""
    tags = {}
    with open(path, "rb") as f:
        head = f.read(16)
        order = {b"II": "<", b"MM": ">"}.get(head[:2])
        if order is None or len(head) < 16:
            return tags
        big = struct.unpack(order + "H", head[2:4])[0] == 43  # BigTIFF: 8-byte offsets and counts
        count_fmt, entry_size, offset = ("Q", 20, head[8:16]) if big else ("H", 12, head[4:8])
        f.seek(struct.unpack(order + ("Q" if big else "I"), offset)[0])
        counted = f.read(struct.calcsize(count_fmt))
        if len(counted) < struct.calcsize(count_fmt):  # a file cut short before its directory (a partial copy)
            return tags
        entries = f.read(min(struct.unpack(order + count_fmt, counted)[0], 4096) * entry_size)
        for at in range(0, len(entries) - entry_size + 1, entry_size):
            entry = entries[at:at + entry_size]
            tag = struct.unpack(order + "H", entry[:2])[0]
            if tag not in TIFF_TAGS or tag in tags:  # a tag given twice: its first, as before
                continue
            values = struct.unpack(order + ("Q" if big else "I"), entry[4:12 if big else 8])[0]
            field = entry[12 if big else 8:]
            if values * 2 > len(field):  # the values are elsewhere: the field holds their offset
                f.seek(struct.unpack(order + ("Q" if big else "I"), field)[0])
                field = f.read(2)
            if len(field) >= 2:
                tags[tag] = struct.unpack(order + "H", field[:2])[0]
    return tags


def predict(session, meta, path):
    image = read(path, meta["config"]["in_channels"] == 1)
    x, (rh, rw) = model_input(image, meta)
    logits = session.run(None, {meta["input"]["name"]: x})[0][0][:, :rh, :rw]          # the image's area
    h, w = image.shape[:2]
    logits = np.stack([cv2.resize(c, (w, h), interpolation=cv2.INTER_LINEAR) for c in logits])  # back to h x w
    if meta["mask"]["rule"] == "threshold":
        return (logits[0] > meta["mask"]["logit"]).astype(np.uint8) * 255
    return logits.argmax(0).astype(np.uint8)


def main(sidecar, source, output):
    meta = load_sidecar(Path(sidecar))
    if meta["config"]["data_mode"] != "fit":
        raise SystemExit("error: a patch-mode model: use python train_unet.py predict backend=onnxruntime")
    if meta["config"].get("tta", "none") != "none":
        print(f"note: the export's run validated with tta={meta['config']['tta']}; this tool predicts each image "
              f"once, without it (train_unet.py predict backend=onnxruntime tta={meta['config']['tta']} applies it)",
              file=sys.stderr)
    session = load_session(Path(sidecar).with_name(meta["onnx"]), meta)
    source, output = Path(source), Path(output)
    if not source.exists():
        raise SystemExit(f"error: {source} not found: give an image, or a folder of images")
    # as predict lists a folder: hidden files (macOS's ._a.png) and folders (x.png/) are not images
    paths = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_EXTS
                                                     and not p.name.startswith(".") and not p.is_dir())
    if not paths:  # it had made the output folder and said '0 mask(s)', exit status 0
        raise SystemExit(f"error: no images ({', '.join(IMAGE_EXTS)}) in {source}: give a folder of images, or one")
    earlier = check_output(paths, output)
    output.mkdir(parents=True, exist_ok=True)
    failed, replaced = [], 0
    for path in paths:
        try:
            write_mask(output / f"{path.stem}.png", predict(session, meta, path))
        except (ValueError, OSError, cv2.error) as exc:  # cv2.error: a layout OpenCV reads, then refuses
            failed.append(path)
            print(f"skipped {path}: {exc}", file=sys.stderr)
            continue
        replaced += output / f"{path.stem}.png" in earlier
    print(f"{len(paths) - len(failed)} mask(s) -> {output}/" + (f" ({replaced} earlier one(s) replaced)" if replaced
          else "") + (f"; {len(failed)} image(s) skipped" if failed else ""))
    if failed:
        raise SystemExit(1)


def load_sidecar(path):
    """The export's sidecar (model.json), or the one-line reason it cannot be: the .onnx given in its place
    (a traceback from the JSON decoder), a file that is not one."""
    twin = path.with_suffix(".json")
    if path.suffix.lower() == ".onnx":
        raise SystemExit(f"error: {path} is the model; give its sidecar, the .json export wrote beside it"
                         + (f": {twin}" if twin.is_file() else ""))
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SystemExit(f"error: cannot read {path} as an export's sidecar ({exc}): give the .json export wrote "
                         f"beside the .onnx") from None
    if not isinstance(meta, dict) or not all(key in meta for key in ("onnx", "config", "preprocessing", "mask")):
        raise SystemExit(f"error: {path} is not an export's sidecar: give the .json export wrote beside the .onnx")
    return meta


def load_session(onnx, meta):
    """onnxruntime's session of the sidecar's .onnx, once that file is checked to be the very one export wrote
    beside it (its SHA-256): a patch-mode .onnx beside a fit-mode sidecar gave masks of fit-mode preprocessing,
    silently, and a cut-short file a traceback from onnxruntime."""
    if not onnx.is_file():
        raise SystemExit(f"error: {onnx} not found (the sidecar's model): keep the .onnx export wrote beside it")
    digest, size = hashlib.sha256(), onnx.stat().st_size
    with open(onnx, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3  # errors only: a damaged graph's warnings would come before the one line
    try:
        session = ort.InferenceSession(str(onnx), quiet, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own errors: one line, not its traceback
        wrote = meta.get("onnx_bytes")
        raise SystemExit(f"error: {onnx} is cut short: {size} of the {wrote} bytes export wrote; copy it again"
                         if isinstance(wrote, int) and size < wrote else
                         f"error: onnxruntime cannot load {onnx} ({str(exc).strip().splitlines()[0]})") from None
    if digest.hexdigest() != meta.get("onnx_sha256"):  # loads, but another export's (a smaller one too)
        raise SystemExit(f"error: {onnx} is not the model its sidecar belongs to (its SHA-256 differs): keep each "
                         f"export's .onnx and .json together")
    return session


def check_output(paths, output):
    """Refused before anything is written: an output folder that holds the images (masks would land among
    them, over an image of the same stem), two inputs of one stem (a.jpg and a.png would both write a.png),
    and a file of a mask's name this tool (or train_unet.py predict) did not write: a ground-truth mask.
    Returns the earlier masks of these images, which it replaces."""
    if output.exists() and not output.is_dir():
        raise SystemExit(f"error: {output} is a file: give the folder the masks go to")
    if output.suffix.lower() in IMAGE_EXTS and not output.is_dir():  # masks.png had become a folder of masks
        raise SystemExit(f"error: {output} names a file, but this tool writes one <stem>.png mask per image into "
                         f"the folder given: give a folder, e.g. {output.parent / output.stem}")
    if output.resolve() in {q for p in paths for q in (p.resolve().parent, p.absolute().parent.resolve())}:
        raise SystemExit(f"error: {output} holds the input images: choose another output folder")
    stems = {}
    for path in paths:
        if path.stem in stems:
            raise SystemExit(f"error: {stems[path.stem].name} and {path.name} would both write {path.stem}.png: "
                             f"rename one, or predict them apart")
        stems[path.stem] = path
    # predict's overlays are colour PNGs; a mask (this tool's own, of an input named <stem>_overlay) is grey
    overlays = [output / f"{stem}_overlay.png" for stem in stems if f"{stem}_overlay" not in stems
                and in_colour(output / f"{stem}_overlay.png")]
    if overlays:
        more = f" and {len(overlays) - 1} more" if len(overlays) > 1 else ""
        raise SystemExit(f"error: {output} holds {overlays[0].name}{more}, predict's overlay of an image this tool "
                         f"would write a mask of: the folder would hold two runs' results for it; choose another "
                         f"output folder, or move them away")
    there = [output / f"{stem}.png" for stem in stems if os.path.lexists(output / f"{stem}.png")]
    foreign = [path for path in there if not (path.is_file() and marked(path))]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise SystemExit(f"error: {output} holds {foreign[0].name}{more}, with no mark of this tool's or predict's "
                         "masks (a ground truth? an image? a mask of an older version, unmarked?): choose another "
                         "output folder, or move them away")
    return set(there)


# The PNG text chunk ("Software: unet-amp predict") train_unet.py predict puts right after the header of
# each mask it writes, and so does this tool: a file without it is never written over.
MARK = struct.pack(">I", 25) + b"tEXt" + b"Software\0unet-amp predict"
MARK += struct.pack(">I", zlib.crc32(MARK[4:]))
PNG_HEADER = 8 + 25  # the signature, then the IHDR chunk


def in_colour(path):
    """Whether a file is a colour PNG (IHDR colour type 2 or 6): predict's overlay, not a mask."""
    try:
        with open(path, "rb") as f:
            head = f.read(26)
    except OSError:
        return False
    return head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) == 26 and head[25] in (2, 6)


def marked(path):
    try:
        with open(path, "rb") as f:
            return f.read(PNG_HEADER + len(MARK))[PNG_HEADER:] == MARK
    except OSError:
        return False


def write_mask(path, mask):
    """The mask as a marked PNG, or an OSError naming why not (cv2.imwrite only returns False)."""
    ok, data = cv2.imencode(".png", mask)
    if not ok:
        raise OSError(f"OpenCV cannot encode {path.name}")
    data, tmp = data.tobytes(), path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:  # whole or not at all: a full disk leaves no half mask
        tmp.write_bytes(data[:PNG_HEADER] + MARK + data[PNG_HEADER:])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
