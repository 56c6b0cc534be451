"""Lossy JPEG image fields: round trips within a stated error, zarr alone reads a frame, bad and crafted frames."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import google_crc32c
import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.errors import CorruptStoreError, StoreError
from her_store.format.frames import build_shard, parse_index
from her_store.format.jpeg import JpegCodec, JpegFrames, check_frames, error_report, jpeg_codec
from her_store.format.keys import chunk_key
from tests.conftest import make_episode

imagecodecs = pytest.importorskip("imagecodecs", reason='pip install "her_store[lossy]"')

T = 5
SHAPE = (3, 16, 16)
# at quality 90 on small smooth frames with edges (as a simulator renders them), over a few frames: the mean and the
# largest absolute error the round trips below must stay within (84x84 frames do better: about 1.7 and 40)
MEAN_BOUND, MAX_BOUND = 4.0, 48


def smooth_frames(n: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Rendered-like uint8 frames: a shaded background and a bright square that moves, channels where ``shape``
    has them."""
    rng = np.random.default_rng(seed)
    h, w = (shape[1], shape[2]) if len(shape) == 3 and shape[0] <= 4 else shape[:2]
    yy, xx = np.mgrid[0:h, 0:w]
    planes = shape[0] if len(shape) == 3 and shape[0] <= 4 else shape[2] if len(shape) == 3 else 1
    out = np.empty((n, planes, h, w), np.uint8)
    for i in range(n):
        x0, y0 = rng.integers(0, max(1, w - 5)), rng.integers(0, max(1, h - 5))
        for c in range(planes):
            img = 40 + 4 * yy + 2 * xx + 20 * c
            img[y0 : y0 + 5, x0 : x0 + 5] = 230 - 40 * c
            out[i, c] = np.clip(img, 0, 255)
    if len(shape) == 2:
        return out[:, 0]
    return out if shape[0] <= 4 else np.ascontiguousarray(out.transpose(0, 2, 3, 1))


def image_spaces(shape: tuple[int, ...] = SHAPE, dtype: type = np.uint8) -> tuple[spaces.Dict, spaces.Box]:
    obs = spaces.Dict(
        {
            "observation": spaces.Box(0, 255, shape, dtype),
            "achieved_goal": spaces.Box(-1, 1, (3,), np.float32),
            "desired_goal": spaces.Box(-1, 1, (3,), np.float32),
        }
    )
    return obs, spaces.Box(-1, 1, (2,), np.float32)


def image_episode(seed: int) -> dict[str, np.ndarray]:
    obs, act = image_spaces()
    ep = make_episode(obs, act, T, seed)
    ep["observation"] = smooth_frames(T + 1, SHAPE, seed)
    return ep


def make_store(path: str, episodes: int = 3, **create) -> list[dict[str, np.ndarray]]:
    obs, act = image_spaces()
    eps = [image_episode(i) for i in range(episodes)]
    with EpisodeStore.create(path, obs, act, compressors={"observation": "jpeg"}, chunk_rows=16, **create) as store:
        for ep in eps:
            store.append_episode(ep)
    return eps


def reward(achieved, desired, info):
    return -(np.linalg.norm(achieved - desired, axis=-1) > 0.05).astype(np.float32)


def test_round_trip_through_a_store_and_a_sampler_stays_within_the_error_bound(store_path):
    from her_store import HerSampler

    eps = make_store(store_path, episodes=3)
    with EpisodeStore.open(store_path) as store:
        decoded = []
        for i, ep in enumerate(eps):
            got = store.episode(i)  # verify=True: the episode's crc32 leaves the lossy frames out
            err = np.abs(got["observation"].astype(int) - ep["observation"])
            assert err.mean() < MEAN_BOUND and err.max() <= MAX_BOUND, (err.mean(), err.max())
            assert err.max() > 0  # lossy indeed: the check above is not comparing a frame with itself
            for k in ("achieved_goal", "desired_goal", "action", "reward"):
                np.testing.assert_array_equal(got[k], ep[k], err_msg=k)
            decoded.append(got["observation"])
        with HerSampler(store, 32, reward_fn=reward, seed=0) as sampler:
            batch = sampler.sample()
        ids, steps = batch.episode_ids.numpy(), batch.steps.numpy()
        want = np.stack([decoded[e][s] for e, s in zip(ids, steps)])
        want_next = np.stack([decoded[e][s + 1] for e, s in zip(ids, steps)])
        np.testing.assert_array_equal(batch.observations["observation"].numpy(), want)
        np.testing.assert_array_equal(batch.next_observations["observation"].numpy(), want_next)


@pytest.mark.parametrize(
    ("shape", "image"),
    [((3, 16, 16), (16, 16, 3)), ((16, 16, 3), (16, 16, 3)), ((16, 16), (16, 16)), ((4, 16, 16), (64, 16)),
     ((16, 16, 4), (64, 16)), ((1, 16, 16), (16, 16))],
)
def test_every_frame_layout_round_trips(shape, image):
    frames = smooth_frames(4, shape, 1)
    assert check_frames(np.uint8, shape).image == image
    coder = JpegFrames(90, np.uint8, shape)
    out = np.empty_like(frames)
    for f, o in zip(frames, out):
        raw = coder.encode(f)
        assert raw[:2] == b"\xff\xd8" and struct.unpack("<I", raw[-4:])[0] == google_crc32c.value(raw[:-4])
        coder.decode(raw, o.reshape(-1))
        # the same image imagecodecs decodes: channels moved where the frame has them, not scrambled
        np.testing.assert_array_equal(imagecodecs.jpeg8_decode(raw[:-4]), coder._to_image(o))
    err = np.abs(out.astype(int) - frames)
    assert err.mean() < MEAN_BOUND and err.max() <= MAX_BOUND, (shape, err.mean(), err.max())


def test_zarr_alone_reads_a_frame_in_a_fresh_process(tmp_path, store_path):
    make_store(store_path, episodes=2)
    with EpisodeStore.open(store_path) as store:
        want = store.episode(1)["observation"][2]
        row = store.index.rows_of(1)[0] + 2
    script = (
        "import sys, zarr, numpy as np\n"
        "assert not any(m.startswith('her_store') for m in sys.modules)\n"
        "a = zarr.open_array(sys.argv[1], mode='r')\n"
        "np.save(sys.argv[2], a[int(sys.argv[3])])\n"
    )
    out = tmp_path / "frame.npy"
    subprocess.run(
        [sys.executable, "-c", script, os.path.join(store_path, "steps", "observation"), str(out), str(row)],
        cwd=tmp_path, check=True, capture_output=True, timeout=120,
    )
    np.testing.assert_array_equal(np.load(out), want)


@pytest.mark.parametrize(
    ("shape", "dtype", "what"),
    [((3, 16, 16), np.float32, "float32"), ((16,), np.uint8, r"shape \(16,\)"), ((2, 3, 16, 16), np.uint8, "shape")],
)
def test_fields_jpeg_cannot_encode_are_refused_at_create_by_name(store_path, shape, dtype, what):
    obs, act = image_spaces(shape, dtype)
    with pytest.raises(StoreError, match=rf"compressors\['observation'\].*{what}"):
        EpisodeStore.create(store_path, obs, act, compressors={"observation": "jpeg"})
    assert not os.path.exists(store_path)


@pytest.mark.parametrize("quality", [0, 101, 90.0, True, "90"])
def test_a_bad_quality_is_refused(quality):
    with pytest.raises(ValueError, match="quality must be an int from 1 to 100"):
        jpeg_codec(quality)


def _sof_dims(jpeg: bytes, rows: int, cols: int) -> bytes:
    at = jpeg.index(b"\xff\xc0")
    return jpeg[: at + 5] + struct.pack(">HH", rows, cols) + jpeg[at + 9 :]


def _with_crc(jpeg: bytes) -> bytes:
    return jpeg + struct.pack("<I", google_crc32c.value(jpeg))


def _crafted(kind: str, good: bytes) -> bytes:
    jpeg = good[:-4]
    other = imagecodecs.jpeg8_encode(np.zeros((8, 8, 3), np.uint8), level=90, subsampling="444")
    if kind == "wrong size":  # a valid JPEG of another frame size, its crc32c right
        return _with_crc(bytes(other))
    if kind == "huge header":  # a header claiming 60000x60000: refused before anything is allocated
        return _with_crc(_sof_dims(jpeg, 60000, 60000))
    if kind == "truncated":  # bytes lost at the end
        return good[: len(good) // 2]
    if kind == "bit flip":  # damage inside the image data
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0x10
        return bytes(flipped)
    if kind == "garbage":
        return _with_crc(np.random.default_rng(0).integers(0, 256, 500, dtype=np.uint8).tobytes())
    if kind == "garbage after SOI":
        return _with_crc(b"\xff\xd8" + np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8).tobytes())
    if kind == "progressive":  # another kind of JPEG than her_store writes (SOF2)
        at = jpeg.index(b"\xff\xc0")
        return _with_crc(jpeg[:at] + b"\xff\xc2" + jpeg[at + 2 :])
    if kind == "no end marker":
        return _with_crc(jpeg[:-2])
    raise AssertionError(kind)


KINDS = [
    "wrong size", "huge header", "truncated", "bit flip", "garbage", "garbage after SOI", "progressive", "no end marker"
]


def test_crafted_frames_are_refused_by_the_frame_decoder():
    coder = JpegFrames(90, np.uint8, SHAPE)
    good = coder.encode(smooth_frames(1, SHAPE, 0)[0])
    out = np.empty(SHAPE, np.uint8)
    coder.decode(good, out.reshape(-1))
    for kind in KINDS:
        with pytest.raises(ValueError):
            coder.decode(_crafted(kind, good), out.reshape(-1))


@pytest.mark.parametrize("kind", ["wrong size", "huge header", "truncated", "bit flip", "garbage"])
def test_a_crafted_frame_in_a_store_gives_corrupt_store_error_from_episode_and_the_sampler(store_path, kind):
    from her_store import HerSampler

    make_store(store_path, episodes=1)
    key = os.path.join(store_path, chunk_key("steps/observation", 0, 4, "."))
    with open(key, "rb") as f:
        raw = f.read()
    offsets, nbytes = parse_index(raw, 16, key)
    frames = [None if o < 0 else raw[o : o + n] for o, n in zip(offsets.tolist(), nbytes.tolist())]
    frames = [None if f is None else _crafted(kind, f) for f in frames]  # every frame, so any sample meets one
    with open(key, "wb") as f:
        f.write(build_shard(frames))
    with EpisodeStore.open(store_path) as store:
        with pytest.raises(CorruptStoreError, match="cannot be decoded"):
            store.episode(0)
        with HerSampler(store, 8, reward_fn=reward, seed=0) as sampler, pytest.raises(CorruptStoreError):
            sampler.sample()


@pytest.mark.parametrize("config", [{"quality": 500}, {"quality": 90, "module": "os"}])
def test_a_store_whose_jpeg_codec_configuration_is_bad_is_corrupt(store_path, config):
    import json

    make_store(store_path, episodes=1)
    meta_path = os.path.join(store_path, "steps", "observation", "zarr.json")
    with open(meta_path) as f:
        meta = json.load(f)
    inner = meta["codecs"][0]["configuration"]["codecs"]
    assert inner[1]["name"] == "her_store.jpeg"
    inner[1]["configuration"] = config
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CorruptStoreError, match="steps/observation"):
        EpisodeStore.open(store_path)


def test_jpeg_without_imagecodecs_gives_the_install_advice(store_path, tmp_path, monkeypatch):
    made = str(tmp_path / "made")
    make_store(made, episodes=1)
    monkeypatch.setitem(sys.modules, "imagecodecs", None)  # what an environment without it imports
    advice = r'pip install "her_store\[lossy\]"'
    with pytest.raises(ImportError, match=advice):
        jpeg_codec()
    obs, act = image_spaces()
    with pytest.raises(ImportError, match=advice):
        EpisodeStore.create(store_path, obs, act, compressors={"observation": "jpeg"})
    assert not os.path.exists(store_path)
    with pytest.raises(ImportError, match=advice):
        EpisodeStore.open(made)


def test_error_report_measures_the_error():
    frames = smooth_frames(6, SHAPE, 3)
    report = error_report(frames)
    coder = JpegFrames(90, np.uint8, SHAPE)
    out = np.empty_like(frames)
    sizes = [len(coder.encode(f)) for f in frames]
    for f, o in zip(frames, out):
        coder.decode(coder.encode(f), o)
    err = np.abs(out.astype(int) - frames)
    mse = np.mean(err.astype(float) ** 2)
    assert report.frames == 6 and report.max_abs_error == err.max() > 0
    assert report.mean_abs_error == pytest.approx(err.mean())
    assert report.psnr_db == pytest.approx(10 * np.log10(255**2 / mse))
    assert report.bytes_per_frame == pytest.approx(np.mean(sizes))
    assert report.ratio == pytest.approx(frames.nbytes / sum(sizes))
    better = error_report(frames, jpeg_codec(quality=98))
    assert better.mean_abs_error < report.mean_abs_error and better.bytes_per_frame > report.bytes_per_frame
    assert "PSNR" in str(report)
    with pytest.raises(ValueError, match="frames of shape"):
        error_report(frames[:0])
    with pytest.raises(ValueError, match="float32"):
        error_report(frames.astype(np.float32), JpegCodec())
