// PCM helpers of the demo page (pure: no DOM, no Web Audio): resampling,
// PCM16 <-> float conversion and base64 for the Realtime protocol's audio fields.

/** Streaming resampler: running-mean prefilter (when downsampling), then linear interpolation. */
export class Resampler {
  constructor(fromRate, toRate) {
    this.step = fromRate / toRate;
    this.width = Math.max(1, Math.round(this.step));
    this.box = new Float32Array(this.width);
    this.boxIndex = 0;
    this.held = new Float32Array(0);
    this.pos = 0;
  }

  process(input) {
    const filtered = this.width > 1 ? this.prefilter(input) : input;
    const data = new Float32Array(this.held.length + filtered.length);
    data.set(this.held);
    data.set(filtered, this.held.length);
    const count = Math.max(0, Math.ceil((data.length - 1 - this.pos) / this.step));
    const out = new Float32Array(count);
    let pos = this.pos;
    for (let n = 0; n < count; n++) {
      const i = Math.floor(pos);
      const frac = pos - i;
      out[n] = data[i] + (data[i + 1] - data[i]) * frac;
      pos += this.step;
    }
    const keep = Math.min(Math.floor(pos), data.length);
    this.held = data.slice(keep);
    this.pos = pos - keep;
    return out;
  }

  prefilter(input) {
    const out = new Float32Array(input.length);
    let sum = this.box.reduce((a, b) => a + b, 0);
    for (let i = 0; i < input.length; i++) {
      sum += input[i] - this.box[this.boxIndex];
      this.box[this.boxIndex] = input[i];
      this.boxIndex = (this.boxIndex + 1) % this.width;
      out[i] = sum / this.width;
    }
    return out;
  }
}

export function floatToPcm16(samples) {
  const bytes = new Uint8Array(samples.length * 2);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return bytes;
}

export function pcm16ToFloat(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Float32Array(Math.floor(bytes.byteLength / 2));
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(i * 2, true) / 32768;
  return out;
}

export function bytesToBase64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

export function base64ToBytes(text) {
  const binary = atob(text);
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}
