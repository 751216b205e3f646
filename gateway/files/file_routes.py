"""`/v1/files` handlers: upload (multipart, `purpose=batch`, each JSONL line checked), list, retrieve,
content, delete. The tenant comes from the API key; another tenant's file is a 404."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from gateway.files.file_store import FileObject, FileStore
from gateway.web import api_errors

BATCH_URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
FORM_FIELDS = frozenset({"file", "purpose"})
MULTIPART_OVERHEAD = 64 << 10  # headers and boundaries around the file part
LIST_PARAMS = frozenset({"purpose", "limit", "after", "order"})


def file_not_found(file_id: str) -> api_errors.ApiError:
    return api_errors.ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


def _store(request: Request) -> FileStore:
    store = request.app.state.files
    if store is None:
        raise api_errors.ApiError(404, "This gateway serves no Files API (no files directory).",
                                  code="not_found")
    return store


async def _tenant(request: Request) -> str:
    return (await request.app.state.service.authenticate(request.headers.get("authorization"))).name


async def upload(request: Request) -> Response:
    tenant, store = await _tenant(request), _store(request)
    limits = store.limits
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise api_errors.invalid("Upload the file as multipart/form-data with fields 'file' and 'purpose'.",
                                 param="file")
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise api_errors.ApiError(411, "A file upload needs a Content-Length.", param="file")
    if int(length) > limits.max_file_bytes + MULTIPART_OVERHEAD:
        raise api_errors.ApiError(413, f"Files are limited to {limits.max_file_bytes} bytes.", param="file")
    count, used = await asyncio.to_thread(store.usage, tenant)
    if count >= limits.max_files_per_tenant:
        raise api_errors.invalid(f"This key's project holds {count} files, the most it may; delete some "
                                 "first.", param="file", code="files_quota_exceeded")
    try:  # slow uploads are cut: 10 s plus one second per MiB
        async with asyncio.timeout(10 + int(length) / (1 << 20)):
            form = await request.form(max_files=1, max_fields=len(FORM_FIELDS), max_part_size=1024)
    except TimeoutError:
        raise api_errors.ApiError(408, "The upload did not arrive in time.", param="file") from None
    try:
        unknown = sorted(set(form.keys()) - FORM_FIELDS)
        if unknown:
            raise api_errors.invalid(f"Unrecognized form field: {unknown[0]!r}.", param=unknown[0])
        if form.get("purpose") != "batch":
            raise api_errors.invalid("Only purpose 'batch' is served here.", param="purpose")
        upload_file = form.get("file")
        if not isinstance(upload_file, UploadFile):
            raise api_errors.invalid("Missing the 'file' part.", param="file")
        staged = store.staging(tenant)
        try:
            size = await asyncio.to_thread(_copy_checked, upload_file, staged, limits.max_file_bytes,
                                           limits.max_lines)
            if used + size > limits.max_tenant_bytes:
                raise api_errors.invalid(f"This key's project would hold more than {limits.max_tenant_bytes} "
                                         "bytes of files; delete some first.", param="file",
                                         code="files_quota_exceeded")
            obj = await asyncio.to_thread(store.put, tenant,
                                          Path(upload_file.filename or "upload.jsonl").name, "batch", staged)
        finally:
            staged.unlink(missing_ok=True)
    finally:
        await form.close()
    return JSONResponse(obj.to_dict())


def _copy_checked(src: UploadFile, dst: Path, max_bytes: int, max_lines: int) -> int:
    """Copy the upload to `dst`, checking each line is a batch request (400 naming the line otherwise)."""
    src.file.seek(0)
    seen: set[str] = set()
    size = 0
    with open(dst, "wb") as out:
        for n, raw in enumerate(src.file, start=1):
            size += len(raw)
            if size > max_bytes:
                raise api_errors.ApiError(413, f"Files are limited to {max_bytes} bytes.", param="file")
            if n > max_lines:
                raise api_errors.invalid(f"A batch file holds at most {max_lines} requests.", param="file")
            if raw.strip():
                _check_line(n, raw, seen)
            out.write(raw)
    if not seen:
        raise api_errors.invalid("The file holds no requests.", param="file")
    return size


def _check_line(n: int, raw: bytes, seen: set[str]) -> None:
    try:
        line: Any = json.loads(raw)
    except ValueError:
        raise api_errors.invalid(f"Line {n} is not valid JSON.", param="file") from None
    if not isinstance(line, dict):
        raise api_errors.invalid(f"Line {n} is not a JSON object.", param="file")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise api_errors.invalid(f"Line {n}: unrecognized field {unknown[0]!r}.", param="file")
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise api_errors.invalid(f"Line {n}: 'custom_id' must be a non-empty string.", param="file")
    if cid in seen:
        raise api_errors.invalid(f"Line {n}: custom_id {cid!r} is used twice.", param="file")
    seen.add(cid)
    if line.get("method") != "POST":
        raise api_errors.invalid(f"Line {n}: 'method' must be POST.", param="file")
    if line.get("url") not in BATCH_URLS:
        raise api_errors.invalid(f"Line {n}: 'url' must be one of {', '.join(sorted(BATCH_URLS))}.",
                                 param="file")
    if not isinstance(line.get("body"), dict):
        raise api_errors.invalid(f"Line {n}: 'body' must be a JSON object.", param="file")


async def list_files(request: Request) -> Response:
    tenant, store = await _tenant(request), _store(request)
    q = request.query_params
    unknown = sorted(set(q.keys()) - LIST_PARAMS)
    if unknown:
        raise api_errors.invalid(f"Unrecognized query parameter: {unknown[0]!r}.", param=unknown[0])
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise api_errors.invalid("'order' must be asc or desc.", param="order")
    try:
        limit = int(q.get("limit", "10000"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 10_000:
        raise api_errors.invalid("'limit' must be an integer from 1 to 10000.", param="limit")
    files: list[FileObject] = await asyncio.to_thread(store.list, tenant)
    if "purpose" in q:
        files = [f for f in files if f.purpose == q["purpose"]]
    if order == "desc":
        files.reverse()
    if "after" in q:
        ids = [f.id for f in files]
        files = files[ids.index(q["after"]) + 1:] if q["after"] in ids else []
    page = files[:limit]
    return JSONResponse({"object": "list", "data": [f.to_dict() for f in page],
                         "has_more": len(files) > limit, "first_id": page[0].id if page else None,
                         "last_id": page[-1].id if page else None})


async def one_file(request: Request) -> Response:
    """GET (the object) or DELETE of one file of the caller's tenant."""
    tenant, store = await _tenant(request), _store(request)
    file_id = request.path_params["file_id"]
    if request.method == "DELETE":
        if not await asyncio.to_thread(store.delete, tenant, file_id):
            raise file_not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
    obj = await asyncio.to_thread(store.get, tenant, file_id)
    if obj is None:
        raise file_not_found(file_id)
    return JSONResponse(obj.to_dict())


async def file_content(request: Request) -> Response:
    tenant, store = await _tenant(request), _store(request)
    file_id = request.path_params["file_id"]
    path = await asyncio.to_thread(store.content_path, tenant, file_id)
    if path is None:
        raise file_not_found(file_id)
    return FileResponse(path, media_type="application/octet-stream")
