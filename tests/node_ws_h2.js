// WebSocket over HTTP/2 (RFC 8441) with Node's own http2 client: frames written by hand.
const http2 = require("http2");
const crypto = require("crypto");
const [proxy, authority, path, text] = process.argv.slice(2);

function frame(opcode, payload) {
  const mask = crypto.randomBytes(4);
  const len = payload.length;
  const head = len < 126 ? Buffer.from([0x80 | opcode, 0x80 | len])
    : Buffer.from([0x80 | opcode, 0x80 | 126, len >> 8, len & 255]);
  const body = Buffer.from(payload);
  for (let i = 0; i < body.length; i++) body[i] ^= mask[i % 4];
  return Buffer.concat([head, mask, body]);
}

const session = http2.connect(proxy);
session.on("error", (e) => { console.log(JSON.stringify({ error: String(e) })); process.exit(1); });
session.on("remoteSettings", (settings) => {
  const req = session.request({
    ":method": "CONNECT", ":protocol": "websocket", ":scheme": "http",
    ":authority": authority, ":path": path, "sec-websocket-version": "13",
  });
  let status = 0, got = Buffer.alloc(0);
  const out = { enableConnectProtocol: settings.enableConnectProtocol };
  req.on("response", (headers) => {
    status = headers[":status"];
    out.status = status;
    req.write(frame(1, Buffer.from(text)));
  });
  req.on("data", (chunk) => {
    got = Buffer.concat([got, chunk]);
    // Unmasked server frames, short payloads: [op, len, payload...]
    while (got.length >= 2 && got.length >= 2 + (got[1] & 127)) {
      const op = got[0] & 15, len = got[1] & 127;
      const payload = got.subarray(2, 2 + len);
      got = got.subarray(2 + len);
      if (op === 1) { out.echo = payload.toString(); req.write(frame(8, Buffer.from([0x03, 0xe8]))); }
      if (op === 8) { out.close = payload.readUInt16BE(0); req.end(); }
    }
  });
  req.on("end", () => { out.ended = true; });
  req.on("close", () => {
    out.rstCode = req.rstCode;
    console.log(JSON.stringify(out));
    session.close();
  });
});
