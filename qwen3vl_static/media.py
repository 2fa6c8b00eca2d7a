"""Images of the HTTP server's requests (`server.py`), fetched and decoded within limits. Not uploaded to the Hub.

An image comes as a `data:` URL (base64), an http(s) URL (fetched with a total time limit and a size cap) or, only when
the server names an allowed folder, a `file://` URL inside it. Each is decoded only after its size in pixels is read
from its header and found within the limit. Whatever is wrong raises `MediaError`, whose message says what to change.
"""

import asyncio
import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 2**20  # an image's encoded size
    max_pixels: int = 4096 * 4096
    timeout_s: float = 10.0  # to fetch one image, in all
    allowed_local_path: Path | None = None  # file:// URLs inside this folder are read; none without it


class MediaError(ValueError):
    """An image that cannot be used; the message says why."""


async def fetch_image(url: str, limits: MediaLimits, client: httpx.AsyncClient) -> Image.Image:
    """The image at `url`, decoded (off the event loop)."""
    return await asyncio.to_thread(decode_image, await fetch_image_data(url, limits, client), limits)


async def fetch_image_data(url: str, limits: MediaLimits, client: httpx.AsyncClient) -> bytes:
    """The encoded image at `url` (not decoded: `decode_image`)."""
    if url.startswith("data:"):
        return _data_url_bytes(url, limits)
    if url.startswith(("http://", "https://")):
        return await _download(url, limits, client)
    if url.startswith("file:"):
        return await asyncio.to_thread(_read_local, url, limits)
    raise MediaError(f"{_short(url)} is not an image URL: use http(s)://, data:image/...;base64,... or (when the "
                     "server allows a folder) file://")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Exception as error:  # noqa: BLE001 - any decoder failure is the client's data
        raise MediaError(f"could not be read as an image ({type(error).__name__}: {error})") from None
    pixels = image.width * image.height
    if pixels > limits.max_pixels:
        raise MediaError(f"{image.width}x{image.height} is {pixels} pixels, more than this server takes "
                         f"({limits.max_pixels}, --max-image-pixels): send a smaller image")
    try:
        image.load()
    except Exception as error:  # noqa: BLE001
        raise MediaError(f"could not be decoded ({type(error).__name__}: {error})") from None
    return image


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError("a data URL must be base64: data:image/png;base64,...")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise MediaError(_too_large(len(payload) * 3 // 4, limits))
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as error:
        raise MediaError(f"its data URL is not valid base64 ({error})") from None


async def _download(url: str, limits: MediaLimits, client: httpx.AsyncClient) -> bytes:
    async def read() -> bytes:
        async with client.stream("GET", url, follow_redirects=True) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching {_short(url)} answered HTTP {response.status_code}")
            declared = int(response.headers.get("content-length") or 0)
            if declared > limits.max_bytes:
                raise MediaError(_too_large(declared, limits))
            data = bytearray()
            async for piece in response.aiter_bytes():
                data += piece
                if len(data) > limits.max_bytes:
                    raise MediaError(_too_large(len(data), limits))
            return bytes(data)

    try:  # a total deadline: httpx's timeouts are per read, which a slow server can keep meeting
        return await asyncio.wait_for(read(), limits.timeout_s)
    except asyncio.TimeoutError:
        raise MediaError(f"fetching {_short(url)} took more than {limits.timeout_s:g} s (--media-timeout)") from None
    except httpx.HTTPError as error:
        raise MediaError(f"could not fetch {_short(url)} ({type(error).__name__}: {error})") from None


def _read_local(url: str, limits: MediaLimits) -> bytes:
    if limits.allowed_local_path is None:
        raise MediaError("local files are not served: send the image as a data: or http(s) URL, or start the server "
                         "with --allowed-local-media-path")
    path = Path(unquote(urlparse(url).path)).resolve()
    allowed = limits.allowed_local_path.resolve()
    if not path.is_relative_to(allowed):
        raise MediaError(f"{path} is outside the folder this server reads images from ({allowed})")
    if not path.is_file():
        raise MediaError(f"{path} is not a file")
    if path.stat().st_size > limits.max_bytes:
        raise MediaError(_too_large(path.stat().st_size, limits))
    return path.read_bytes()


def _too_large(size: int, limits: MediaLimits) -> str:
    return (f"{size} bytes is more than this server takes for an image ({limits.max_bytes}, --max-image-mb): send a "
            "smaller file")


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."
