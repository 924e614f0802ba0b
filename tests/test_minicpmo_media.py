"""The MiniCPM-o stage's media builder: units' frames and audio in vLLM's MiniCPM-o form.

vLLM's MiniCPM-o model takes ``multi_modal_data`` with PIL images under
``image`` and float32 16 kHz arrays under ``audio``, each list in the order
of its placeholders in the prompt. These tests check the pure builder
(``minicpmo_media``) and that the duplex prompt keeps each segment's media
with it, so a dropped segment takes its media along.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from schemas.events import AudioPayload, TextPayload, UnitPayload, VideoPayload
from workers.backends.minicpmo_media import (
    decode_audio,
    engine_prompt,
    multi_modal_data,
    unit_media,
)
from workers.backends.minicpmo_session import DuplexPrompt


def png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def tone(seconds: float, rate: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_a_unit_becomes_its_frames_then_its_audio():
    samples = tone(1.0)
    payload = UnitPayload(
        audio=AudioPayload(samples.astype("<f4").tobytes()),
        video=VideoPayload((png((640, 480), (255, 0, 0)), png((320, 240), (0, 0, 255)))),
    )
    media = unit_media(payload)
    assert [image.size for image in media.images] == [(640, 480), (320, 240)]
    assert [image.mode for image in media.images] == ["RGB", "RGB"]
    assert media.images[0].getpixel((0, 0)) == (255, 0, 0)  # base frame first
    (audio,) = media.audio
    assert audio.dtype == np.float32 and audio.shape == (16_000,)
    np.testing.assert_array_equal(audio, samples)
    assert media.problems == ()


def test_integer_pcm_is_scaled_and_other_rates_are_resampled_to_16k():
    ints = np.array([0, 16384, -32768, 32767], dtype="<i2")
    scaled = decode_audio(AudioPayload(ints.tobytes(), format="pcm_s16le"))
    np.testing.assert_allclose(scaled, [0.0, 0.5, -1.0, 32767 / 32768])
    slow = tone(0.5, rate=8_000)
    resampled = decode_audio(AudioPayload(slow.astype("<f4").tobytes(), sample_rate=8_000))
    assert resampled.dtype == np.float32 and resampled.shape == (8_000,)
    # Linear interpolation keeps the 440 Hz tone: every other sample is the original.
    np.testing.assert_allclose(resampled[::2][:3999], slow[:3999], atol=1e-6)


def test_what_cannot_be_decoded_is_dropped_and_named():
    media = unit_media(
        UnitPayload(
            audio=AudioPayload(b"\x00" * 5),  # not whole float32 samples
            video=VideoPayload((b"not an image", png((8, 8), (0, 0, 0)))),
        )
    )
    assert len(media.images) == 1 and media.audio == ()
    assert media.problems == (
        "frame 0 is not an image Pillow can decode",
        "audio in 'pcm_f32le' cannot be decoded",
    )
    assert decode_audio(AudioPayload(b"\x00" * 8, format="opus")) is None
    assert not unit_media(TextPayload("hello"))


def test_the_prompt_keeps_media_in_order_and_drops_it_with_its_segment():
    first = unit_media(VideoPayload((png((10, 10), (1, 1, 1)),)))
    second = unit_media(AudioPayload(tone(1.0).tobytes()))
    third = unit_media(
        UnitPayload(
            audio=AudioPayload(tone(0.5).tobytes()), video=VideoPayload((png((20, 20), (2, 2, 2)),))
        )
    )
    prompt = DuplexPrompt()
    prompt.add((1,) * 66, first)
    prompt.add((2,) * 12, second)
    prompt.add((3,) * 4)  # a text append: no media
    prompt.answer((9, 9))  # the model's tokens extend the text's segment
    prompt.add((1,) * 66 + (2,) * 16, third)
    data = multi_modal_data(prompt.media)
    assert [image.size for image in data["image"]] == [(10, 10), (20, 20)]
    assert [len(audio) for audio in data["audio"]] == [16_000, 8_000]
    assert len(prompt.media) == len(prompt.segments) == 4

    assert prompt.fit(len(prompt) - 66) == 1  # the oldest segment (the first frame) goes
    data = multi_modal_data(prompt.media)
    assert [image.size for image in data["image"]] == [(20, 20)]
    assert [len(audio) for audio in data["audio"]] == [16_000, 8_000]
    assert len(prompt.media) == len(prompt.segments) == 3


def test_a_prompt_without_media_sends_none():
    prompt = DuplexPrompt()
    prompt.add((1, 2, 3))
    assert multi_modal_data(prompt.media) is None
    assert multi_modal_data([]) is None


def test_the_engine_gets_one_marker_per_item_in_place_of_each_placeholder_run():
    unk, image, audio = 0, (7, 8), (9,)
    pair = VideoPayload((png((10, 10), (1, 1, 1)), png((10, 10), (2, 2, 2))))
    prompt = DuplexPrompt(prefix=(unk,) * 3)
    prompt.add(
        (unk,) * (198 + 12), unit_media(UnitPayload(AudioPayload(tone(1.0).tobytes()), pair), 210)
    )
    prompt.answer((40, 41))  # the model's answer to the unit stays after its markers
    prompt.add((50, 51))  # text: sent as it is
    prompt.add((unk,) * 16, unit_media(AudioPayload(tone(0.5).tobytes()), 16))
    sent = engine_prompt(prompt.prefix, prompt.segments, prompt.media, image, audio)
    assert sent == [unk] * 3 + [7, 8, 7, 8, 9, 40, 41] + [50, 51] + [9]
